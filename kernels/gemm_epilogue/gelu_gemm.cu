// cuBLASLt calls of gelu_gemm.h. cuBLAS is column-major: a row-major [r, c] matrix is a
// column-major [c, r] one, so both products are computed transposed, with the hidden dimension as
// the rows m of D (the bias runs along m, as cuBLASLt wants) and the tokens as its columns n.
#include "gemm_epilogue/gelu_gemm.h"

namespace mhla_kernels {

bool gelu_gemm_supported(int64_t rows, int64_t depth, int64_t columns) {
  return rows > 0 && depth > 0 && columns > 0 && depth % 8 == 0 && columns % 8 == 0;
}

const char* gelu_gemm_forward(const GeluGemmForward& g, const EpilogueContext& context) {
  if (!gelu_gemm_supported(g.rows, g.in_features, g.hidden)) {
    return "GELU product: sizes must be positive multiples of 8";
  }
  // D [hidden, rows] = W1 [hidden, in] (stored [in, hidden] column-major) x [in, rows].
  EpilogueProduct p;
  p.dtype = p.d_dtype = g.dtype;
  p.m = g.hidden, p.n = g.rows, p.k = g.in_features;
  p.transpose_a = true, p.lda = g.in_features, p.ldb = g.in_features;
  p.a = g.weight, p.b = g.x, p.d = g.out;
  p.epilogue = g.pre != nullptr ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_BIAS;
  p.bias = g.bias;
  p.aux = g.pre, p.aux_ld = g.hidden;
  return run_epilogue_product(p, context);
}

const char* gelu_gemm_backward(const GeluGemmBackward& g, const EpilogueContext& context) {
  if (!gelu_gemm_supported(g.rows, g.out_features, g.hidden)) {
    return "GELU product: sizes must be positive multiples of 8";
  }
  // D [hidden, rows] = W2^T [hidden, out] (W2 [out, hidden] row-major is that, column-major)
  // x dy^T [out, rows].
  EpilogueProduct p;
  p.dtype = p.d_dtype = g.dtype;
  p.m = g.hidden, p.n = g.rows, p.k = g.out_features;
  p.transpose_a = false, p.lda = g.hidden, p.ldb = g.out_features;
  p.a = g.weight, p.b = g.grad_out, p.d = g.grad_pre;
  p.epilogue = g.grad_bias != nullptr ? CUBLASLT_EPILOGUE_DGELU_BGRAD : CUBLASLT_EPILOGUE_DGELU;
  p.bias = g.grad_bias;
  p.aux = g.pre, p.aux_ld = g.hidden;
  return run_epilogue_product(p, context);
}

}  // namespace mhla_kernels
