#pragma once
// Rotary position embedding (RoPE, half-split convention) on the GPU in one pass: reads a
// [B, T, H, D] view (any strides, last dimension contiguous) once, rotates each pair
// (x_i, x_{i+D/2}) by the angle of its token and frequency in fp32, writes a contiguous output.
//
//   y_i = x_i cos - x_{i+D/2} sin,   y_{i+D/2} = x_{i+D/2} cos + x_i sin   (i < D/2)
//
// The backward is the same rotation by the opposite angles (the caller passes -sin). cos and sin
// are fp32 tables [T, D/2] computed by the caller, so both directions and the plain-LibTorch
// reference share the same angles.
#include <cstdint>

#include <cuda_runtime.h>

#include "mhla/block_linear_attention.h"  // DType, TokenTensor

namespace mhla_kernels {

struct RotaryArgs {
  DType dtype = DType::bf16;
  TokenTensor x;                 // [B, T, H, D] view
  void* out = nullptr;           // contiguous [B, T, H, D], same dtype
  const float* cos = nullptr;    // [T, D / 2]
  const float* sin = nullptr;    // [T, D / 2]
  int batch = 0, tokens = 0, heads = 0, head_dim = 0;  // head_dim even
};

cudaError_t rotary_embedding(const RotaryArgs& args, cudaStream_t stream);

}  // namespace mhla_kernels
