// cuBLASLt calls of gelu_gemm.h. cuBLAS is column-major: a row-major [r, c] matrix is a
// column-major [c, r] one, so both products are computed transposed, with the hidden dimension as
// the rows m of D (the bias runs along m, as cuBLASLt wants) and the tokens as its columns n.
#include "gemm_epilogue/gelu_gemm.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <tuple>

namespace mhla_kernels {
namespace {

cudaDataType_t cuda_type(DType dtype) {
  switch (dtype) {
    case DType::bf16:
      return CUDA_R_16BF;
    case DType::f16:
      return CUDA_R_16F;
    default:
      return CUDA_R_32F;
  }
}

// The largest power of two up to 256 that divides the address (cuBLASLt picks kernels by it).
uint32_t alignment_of(const void* p) {
  const auto address = reinterpret_cast<uintptr_t>(p);
  uint32_t alignment = 256;
  while (alignment > 1 && address % alignment != 0) alignment /= 2;
  return alignment;
}

// Frees cuBLASLt descriptors at scope exit.
struct Descriptors {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulPreference_t preference = nullptr;
  ~Descriptors() {
    if (preference) cublasLtMatmulPreferenceDestroy(preference);
    if (d) cublasLtMatrixLayoutDestroy(d);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

// One product D [m, n] = op(A) B with an epilogue, in column-major terms.
struct Product {
  DType dtype;
  int64_t m, n, k;
  bool transpose_a;
  int64_t lda, ldb;
  const void *a, *b;
  void* d;
  cublasLtEpilogue_t epilogue;
  const void* bias;  // bias (forward) or bias gradient (backward) pointer
  const void* aux;
  int64_t aux_ld;
};

// Algorithms found by the heuristics, per problem (they do not depend on the data).
using AlgoKey = std::tuple<int, int, int64_t, int64_t, int64_t, uint32_t, size_t>;
std::mutex cache_mutex;
std::map<AlgoKey, cublasLtMatmulAlgo_t> algo_cache;

const char* status_text(cublasStatus_t status) {
  return cublasLtGetStatusString(status);
}

#define GELU_GEMM_CHECK(call, what)                               \
  do {                                                            \
    const cublasStatus_t status_ = (call);                        \
    if (status_ != CUBLAS_STATUS_SUCCESS) {                       \
      static thread_local std::string message_;                   \
      message_ = std::string(what) + ": " + status_text(status_); \
      return message_.c_str();                                    \
    }                                                             \
  } while (0)

cublasStatus_t multiply(const Product& p, const Descriptors& s, const cublasLtMatmulAlgo_t& algo,
                        const GeluGemmContext& context) {
  const float one = 1.f, zero = 0.f;
  return cublasLtMatmul(context.handle, s.op, &one, p.a, s.a, p.b, s.b, &zero, p.d, s.d, p.d, s.d,
                        &algo, context.workspace, context.workspace_bytes, context.stream);
}

const char* run(const Product& p, const GeluGemmContext& context) {
  const cudaDataType_t type = cuda_type(p.dtype);
  Descriptors s;
  GELU_GEMM_CHECK(cublasLtMatmulDescCreate(&s.op, CUBLAS_COMPUTE_32F, CUDA_R_32F),
                  "cublasLtMatmulDescCreate");
  const cublasOperation_t trans_a = p.transpose_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t trans_b = CUBLAS_OP_N;
  auto set = [&](cublasLtMatmulDescAttributes_t attribute, const void* value, size_t bytes) {
    return cublasLtMatmulDescSetAttribute(s.op, attribute, value, bytes);
  };
  GELU_GEMM_CHECK(set(CUBLASLT_MATMUL_DESC_TRANSA, &trans_a, sizeof(trans_a)), "transa");
  GELU_GEMM_CHECK(set(CUBLASLT_MATMUL_DESC_TRANSB, &trans_b, sizeof(trans_b)), "transb");
  GELU_GEMM_CHECK(set(CUBLASLT_MATMUL_DESC_EPILOGUE, &p.epilogue, sizeof(p.epilogue)), "epilogue");
  if (p.bias != nullptr) {
    GELU_GEMM_CHECK(set(CUBLASLT_MATMUL_DESC_BIAS_POINTER, &p.bias, sizeof(p.bias)), "bias");
  }
  if (p.aux != nullptr) {
    GELU_GEMM_CHECK(set(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &p.aux, sizeof(p.aux)),
                    "aux pointer");
    GELU_GEMM_CHECK(set(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &p.aux_ld, sizeof(p.aux_ld)),
                    "aux ld");
  }
  // A as stored: [k, m] when transposed, else [m, k]; B [k, n]; D [m, n]; all column-major.
  GELU_GEMM_CHECK(cublasLtMatrixLayoutCreate(&s.a, type, p.transpose_a ? p.k : p.m,
                                             p.transpose_a ? p.m : p.k, p.lda),
                  "layout A");
  GELU_GEMM_CHECK(cublasLtMatrixLayoutCreate(&s.b, type, p.k, p.n, p.ldb), "layout B");
  GELU_GEMM_CHECK(cublasLtMatrixLayoutCreate(&s.d, type, p.m, p.n, p.m), "layout D");

  // Every pointer's alignment is part of the problem (the heuristics assume 256 bytes unless
  // told); the least of them keys the cache.
  uint32_t alignment = 256;
  for (const void* ptr : {p.a, p.b, static_cast<const void*>(p.d)}) {
    alignment = std::min(alignment, alignment_of(ptr));
  }
  const AlgoKey key{
      static_cast<int>(p.dtype), static_cast<int>(p.epilogue), p.m, p.n, p.k, alignment,
      context.workspace_bytes};
  cublasLtMatmulAlgo_t algo;
  bool cached = false;
  {
    std::lock_guard<std::mutex> lock(cache_mutex);
    auto found = algo_cache.find(key);
    if (found != algo_cache.end()) algo = found->second, cached = true;
  }
  if (!cached) {
    GELU_GEMM_CHECK(cublasLtMatmulPreferenceCreate(&s.preference), "preference");
    GELU_GEMM_CHECK(cublasLtMatmulPreferenceSetAttribute(
                        s.preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                        &context.workspace_bytes, sizeof(context.workspace_bytes)),
                    "workspace preference");
    for (auto attribute :
         {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
          CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES}) {
      GELU_GEMM_CHECK(cublasLtMatmulPreferenceSetAttribute(s.preference, attribute, &alignment,
                                                           sizeof(alignment)),
                      "alignment preference");
    }
    cublasLtMatmulHeuristicResult_t result;
    std::memset(&result, 0, sizeof(result));
    int found = 0;
    GELU_GEMM_CHECK(cublasLtMatmulAlgoGetHeuristic(context.handle, s.op, s.a, s.b, s.d, s.d,
                                                   s.preference, 1, &result, &found),
                    "cublasLtMatmulAlgoGetHeuristic");
    if (found == 0) return "cuBLASLt has no algorithm for this GELU product";
    // (Timing the heuristics' first eight candidates on first use gained 0.4 % of a DiT-S step
    // at 1,024 tokens on the H200, within the probes' noise: not kept.)
    algo = result.algo;
    std::lock_guard<std::mutex> lock(cache_mutex);
    algo_cache.emplace(key, algo);
  }
  GELU_GEMM_CHECK(multiply(p, s, algo, context), "cublasLtMatmul");
  return nullptr;
}

}  // namespace

bool gelu_gemm_supported(int64_t rows, int64_t depth, int64_t columns) {
  return rows > 0 && depth > 0 && columns > 0 && depth % 8 == 0 && columns % 8 == 0;
}

const char* gelu_gemm_forward(const GeluGemmForward& g, const GeluGemmContext& context) {
  if (!gelu_gemm_supported(g.rows, g.in_features, g.hidden)) {
    return "GELU product: sizes must be positive multiples of 8";
  }
  // D [hidden, rows] = W1 [hidden, in] (stored [in, hidden] column-major) x [in, rows].
  Product p{};
  p.dtype = g.dtype;
  p.m = g.hidden, p.n = g.rows, p.k = g.in_features;
  p.transpose_a = true, p.lda = g.in_features, p.ldb = g.in_features;
  p.a = g.weight, p.b = g.x, p.d = g.out;
  p.epilogue = g.pre != nullptr ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_BIAS;
  p.bias = g.bias;
  p.aux = g.pre, p.aux_ld = g.hidden;
  return run(p, context);
}

const char* gelu_gemm_backward(const GeluGemmBackward& g, const GeluGemmContext& context) {
  if (!gelu_gemm_supported(g.rows, g.out_features, g.hidden)) {
    return "GELU product: sizes must be positive multiples of 8";
  }
  // D [hidden, rows] = W2^T [hidden, out] (W2 [out, hidden] row-major is that, column-major)
  // x dy^T [out, rows].
  Product p{};
  p.dtype = g.dtype;
  p.m = g.hidden, p.n = g.rows, p.k = g.out_features;
  p.transpose_a = false, p.lda = g.hidden, p.ldb = g.out_features;
  p.a = g.weight, p.b = g.grad_out, p.d = g.grad_pre;
  p.epilogue = g.grad_bias != nullptr ? CUBLASLT_EPILOGUE_DGELU_BGRAD : CUBLASLT_EPILOGUE_DGELU;
  p.bias = g.grad_bias;
  p.aux = g.pre, p.aux_ld = g.hidden;
  return run(p, context);
}

}  // namespace mhla_kernels
