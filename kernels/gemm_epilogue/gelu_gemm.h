#pragma once
// The two matrix products of a GELU MLP that carry the activation in their epilogue (cuBLASLt),
// so the hidden activation is never read or written by a separate elementwise pass:
//
//   forward   h = gelu(x W1^T + b1), and pre = x W1^T + b1 kept for the backward;
//   backward  d_pre = (dy W2) * gelu'(pre) (DGELU), optionally with d_b1 = the column sums of
//             d_pre (DGELU_BGRAD: in the output's dtype, cuBLASLt's rule; on the H200 cuBLASLt
//             ran that reduction as a slow separate kernel, so the caller sums d_pre itself).
//
// In a DiT-S MLP at 1,024 tokens the hidden activation is [262,144, 1,536]: 805 MB in bf16, which
// the unfused path passes through a separate GELU forward and GELU backward. cuBLASLt's GELU is
// the tanh approximation, 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), so this serves
// `model.mlp: gelu_tanh` (tests/test_gelu_mlp.cpp checks which form the library computes).
//
// Row-major operands on raw device pointers, all contiguous: x [rows, in], W1 [hidden, in],
// b1 [hidden], h and pre [rows, hidden]; dy [rows, out], W2 [out, hidden], d_pre [rows, hidden],
// d_b1 [hidden]. in, hidden and out must be multiples of 8 and the pointers 16-byte aligned.
// No LibTorch here: the caller hands in the cuBLASLt handle and a workspace.
#include <cstdint>

#include "gemm_epilogue/epilogue_product.h"

namespace mhla_kernels {

struct GeluGemmForward {
  DType dtype = DType::bf16;
  int64_t rows = 0, in_features = 0, hidden = 0;
  const void* x = nullptr;
  const void* weight = nullptr;  // W1
  const void* bias = nullptr;    // b1, in dtype
  void* out = nullptr;           // h
  void* pre = nullptr;           // x W1^T + b1; nullptr: not kept (inference)
};

struct GeluGemmBackward {
  DType dtype = DType::bf16;
  int64_t rows = 0, out_features = 0, hidden = 0;
  const void* grad_out = nullptr;  // dy
  const void* weight = nullptr;    // W2
  const void* pre = nullptr;       // the forward's pre
  void* grad_pre = nullptr;        // d_pre
  void* grad_bias = nullptr;       // d_b1, in dtype; nullptr: d_pre only (the DGELU epilogue)
};

// Whether the products take these sizes (multiples of 8, positive).
bool gelu_gemm_supported(int64_t rows, int64_t depth, int64_t columns);

// nullptr when done; otherwise what failed, for the caller's error message (valid until this
// thread's next call).
const char* gelu_gemm_forward(const GeluGemmForward& args, const EpilogueContext& context);
const char* gelu_gemm_backward(const GeluGemmBackward& args, const EpilogueContext& context);

}  // namespace mhla_kernels
