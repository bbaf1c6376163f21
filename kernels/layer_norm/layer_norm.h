#pragma once
// LayerNorm over the last dimension, forward and backward, for the transformer blocks on the GPU.
// Why our own: ATen's kernels for many short rows (65,536 rows of 192 under bf16 autocast) spend
// most of their time in the weight/bias gradient (a reduction over rows with few columns) and
// write fp32 that the next matmul casts to bf16 again. Here the forward writes the output dtype
// directly (bf16 under autocast) and the backward reduces the weight/bias gradient per CTA in
// shared memory, then over CTAs in a second small kernel.
#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

#include "mhla/block_linear_attention.h"  // DType

namespace mhla_kernels {

constexpr int kLayerNormMaxColumns = 1024;

struct LayerNormForwardArgs {
  DType in_dtype = DType::f32;    // x
  DType out_dtype = DType::bf16;  // y
  int64_t rows = 0;
  int cols = 0;  // <= kLayerNormMaxColumns
  float eps = 1e-5f;
  const void* x = nullptr;        // [rows, cols] contiguous
  const float* weight = nullptr;  // [cols] or null (no affine)
  const float* bias = nullptr;    // [cols] or null
  void* y = nullptr;              // [rows, cols]
  float* mean = nullptr;          // [rows], may be null (inference)
  float* rstd = nullptr;          // [rows], may be null
};

cudaError_t layer_norm_forward(const LayerNormForwardArgs& args, cudaStream_t stream);

struct LayerNormBackwardArgs {
  DType in_dtype = DType::f32;     // x and dx
  DType grad_dtype = DType::bf16;  // dy
  int64_t rows = 0;
  int cols = 0;
  const void* x = nullptr;
  const void* dy = nullptr;
  const float* mean = nullptr;
  const float* rstd = nullptr;
  const float* weight = nullptr;  // null: no affine (dweight, dbias unused)
  void* dx = nullptr;
  float* dweight = nullptr;    // [cols], written (not accumulated); null to skip
  float* dbias = nullptr;      // [cols]
  float* workspace = nullptr;  // layer_norm_backward_workspace_floats(rows, cols) floats
};

size_t layer_norm_backward_workspace_floats(int64_t rows, int cols);
cudaError_t layer_norm_backward(const LayerNormBackwardArgs& args, cudaStream_t stream);

}  // namespace mhla_kernels
