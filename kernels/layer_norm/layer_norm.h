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
  // Optional residual add in front (the hinge between two pre-norm branches): the row normalized
  // is x + scale[row / rows_per_sample] * branch, and it is also written to `sum`. Needs fp32 x;
  // branch in out_dtype; scale null for 1 (no stochastic depth).
  const void* branch = nullptr;  // [rows, cols]
  const float* scale = nullptr;  // [rows / rows_per_sample]
  int64_t rows_per_sample = 1;
  float* sum = nullptr;          // [rows, cols] fp32; set together with branch
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
  // Optional, for a forward with the residual add: dx += dsum (the gradient the residual stream
  // brings from later uses; null for none), and dbranch = scale[sample] * dx in grad_dtype (null
  // to skip). Needs fp32 x/dx.
  const float* dsum = nullptr;   // [rows, cols]
  void* dbranch = nullptr;       // [rows, cols]
  const float* scale = nullptr;  // [rows / rows_per_sample] or null (1)
  int64_t rows_per_sample = 1;
};

size_t layer_norm_backward_workspace_floats(int64_t rows, int cols);
cudaError_t layer_norm_backward(const LayerNormBackwardArgs& args, cudaStream_t stream);

}  // namespace mhla_kernels
