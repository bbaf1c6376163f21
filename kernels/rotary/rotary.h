#pragma once
// Rotary position embedding (RoPE, half-split convention) on the GPU in one pass over up to three
// [B, T, H, D] views (any strides, last dimension contiguous): the first `rotated` of them are
// rotated pair by pair, (x_i, x_{i+D/2}) by the angle of their token and frequency in fp32, the
// rest copied, each into its own strided output view.
//
//   y_i = x_i cos - x_{i+D/2} sin,   y_{i+D/2} = x_{i+D/2} cos + x_i sin   (i < D/2)
//
// An attention layer's forward passes q, k, v (views into the fused projection) and gets three
// contiguous tensors; its backward passes dq, dk, dv and writes them rotated back (the same kernel
// with the opposite angles: sin_sign = -1) straight into the projection's gradient, so no
// separate stacking pass. cos and sin are fp32 tables [T, D/2] computed by the caller, so both
// directions and the plain-LibTorch reference share the same angles.
#include <cstdint>

#include <cuda_runtime.h>

#include "mhla/block_linear_attention.h"  // DType, TokenTensor

namespace mhla_kernels {

struct MutableTokenTensor {  // a writable [B, T, H, D] view
  void* data = nullptr;
  int64_t batch_stride = 0, token_stride = 0, head_stride = 0;
};

struct RotaryArgs {
  DType dtype = DType::bf16;
  int parts = 1;    // views in `in` / `out` (1..3)
  int rotated = 1;  // the first `rotated` parts are rotated, the others copied
  TokenTensor in[3];
  MutableTokenTensor out[3];
  const float* cos = nullptr;  // [T, D / 2]
  const float* sin = nullptr;  // [T, D / 2]
  float sin_sign = 1.f;        // -1: rotate by the opposite angles (the backward)
  int batch = 0, tokens = 0, heads = 0, head_dim = 0;  // head_dim even
};

cudaError_t rotary_embedding(const RotaryArgs& args, cudaStream_t stream);

}  // namespace mhla_kernels
