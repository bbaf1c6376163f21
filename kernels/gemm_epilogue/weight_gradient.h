#pragma once
// A linear layer's weight and bias gradients in one cuBLASLt product: dW = dy^T x in fp32 and
// db = the column sums of dy, in fp32, reduced by the product's epilogue (BGRADB) while it reads
// dy anyway. Without it the bias gradient is a separate pass over dy (kernels/column_sum): in a
// DiT-S step at 1,024 tokens, 63 such passes over about 18 GB.
//
// Row-major operands on raw device pointers, contiguous: dy [rows, out], x [rows, in] in dtype
// (bf16 or fp16), dW [out, in] and db [out] fp32. in and out must be multiples of 8.
#include <cstdint>

#include "gemm_epilogue/epilogue_product.h"

namespace mhla_kernels {

struct WeightGradient {
  DType dtype = DType::bf16;
  int64_t rows = 0, in_features = 0, out_features = 0;
  const void* grad_out = nullptr;  // dy
  const void* x = nullptr;
  float* grad_weight = nullptr;
  float* grad_bias = nullptr;  // nullptr: dW only
};

bool weight_gradient_supported(DType dtype, int64_t rows, int64_t in_features,
                               int64_t out_features);
const char* weight_gradient(const WeightGradient& args, const EpilogueContext& context);

}  // namespace mhla_kernels
