#pragma once
// Column sums of a row-major [rows, cols] matrix into fp32: the bias gradient of a linear layer
// (the sum of the output gradient over every token). ATen reduces a bf16 [65,536, 768] gradient
// over its outer dimension at about 0.6 TB/s on the H200; here each CTA sums a slab of rows for a
// tile of columns (16-byte row reads), and a second small kernel adds the slabs in a fixed order
// (deterministic, no atomics).
//
// With gelu_input set, the rows summed are the GELU backward of x instead (the tanh form, or the
// exact erf form with gelu_exact): x * gelu'(gelu_input), which also goes to gelu_grad: a GELU
// MLP's hidden-layer gradient and its bias gradient in one pass (models/gelu_mlp.h), where torch's
// GELU backward writes it and the bias gradient reads it again.
#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

#include "mhla/block_linear_attention.h"  // DType

namespace mhla_kernels {

struct ColumnSumArgs {
  DType dtype = DType::bf16;
  int64_t rows = 0;
  int cols = 0;
  const void* x = nullptr;           // [rows, cols] contiguous
  float* out = nullptr;              // [cols]
  float* workspace = nullptr;        // column_sum_workspace_floats(rows, cols) floats
  const void* gelu_input = nullptr;  // [rows, cols] in dtype, or nullptr: plain column sums
  void* gelu_grad = nullptr;         // [rows, cols] in dtype, written with gelu_input
  bool gelu_exact = false;           // with gelu_input: the erf form's gelu' (else the tanh form's)
};

size_t column_sum_workspace_floats(int64_t rows, int cols);
cudaError_t column_sum(const ColumnSumArgs& args, cudaStream_t stream);

}  // namespace mhla_kernels
