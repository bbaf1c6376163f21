// cuBLASLt call of weight_gradient.h. Column-major, dW [out, in] row-major is D [in, out]:
// D = x^T-as-stored [in, rows] times op(B) = dy as [rows, out] (stored [out, rows], transposed),
// so the bias gradient runs along D's columns (BGRADB, reduced over k = rows).
#include "gemm_epilogue/weight_gradient.h"

namespace mhla_kernels {

bool weight_gradient_supported(DType dtype, int64_t rows, int64_t in_features,
                               int64_t out_features) {
  return (dtype == DType::bf16 || dtype == DType::f16) && rows > 0 && in_features > 0 &&
         out_features > 0 && in_features % 8 == 0 && out_features % 8 == 0;
}

const char* weight_gradient(const WeightGradient& g, const EpilogueContext& context) {
  if (!weight_gradient_supported(g.dtype, g.rows, g.in_features, g.out_features)) {
    return "weight-gradient product: 16-bit inputs and feature counts that are multiples of 8";
  }
  EpilogueProduct p;
  p.dtype = g.dtype;
  p.d_dtype = DType::f32;
  p.m = g.in_features, p.n = g.out_features, p.k = g.rows;
  p.transpose_a = false, p.lda = g.in_features;
  p.transpose_b = true, p.ldb = g.out_features;
  p.a = g.x, p.b = g.grad_out, p.d = g.grad_weight;
  p.epilogue = g.grad_bias != nullptr ? CUBLASLT_EPILOGUE_BGRADB : CUBLASLT_EPILOGUE_DEFAULT;
  p.bias = g.grad_bias;
  return run_epilogue_product(p, context);
}

}  // namespace mhla_kernels
