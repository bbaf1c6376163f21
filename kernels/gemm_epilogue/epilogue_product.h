#pragma once
// One cuBLASLt product with an epilogue, D [m, n] = op(A) op(B), column-major as cuBLAS sees it:
// the shared machinery of the fused products in this folder (descriptors, the heuristics' choice
// cached per problem, error text). fp32 accumulation; A and B in `dtype`, D in `d_dtype`.
#include <cstddef>
#include <cstdint>

#include <cublasLt.h>
#include <cuda_runtime.h>

#include "mhla/block_linear_attention.h"  // DType

namespace mhla_kernels {

struct EpilogueContext {
  cublasLtHandle_t handle = nullptr;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  cudaStream_t stream = nullptr;
};

// The workspace cuBLASLt may use (bytes); the heuristics are asked for algorithms within it.
constexpr size_t kEpilogueWorkspaceBytes = size_t{32} << 20;

struct EpilogueProduct {
  DType dtype = DType::bf16;    // A and B
  DType d_dtype = DType::bf16;  // D (and a bias gradient)
  int64_t m = 0, n = 0, k = 0;
  bool transpose_a = false, transpose_b = false;
  int64_t lda = 0, ldb = 0;  // D's leading dimension is m
  const void* a = nullptr;
  const void* b = nullptr;
  void* d = nullptr;
  cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_DEFAULT;
  const void* bias = nullptr;  // bias (input) or bias gradient (output), per the epilogue
  const void* aux = nullptr;   // GELU input (written by GELU_AUX forms, read by DGELU)
  int64_t aux_ld = 0;
};

// nullptr when done; otherwise what failed (valid until this thread's next call).
const char* run_epilogue_product(const EpilogueProduct& product, const EpilogueContext& context);

}  // namespace mhla_kernels
