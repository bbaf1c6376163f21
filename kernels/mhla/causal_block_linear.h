#pragma once
// Causal block linear attention on the GPU (language models): causal linear attention and causal
// MHLA, chunkwise with 64-token blocks, forward and backward.
//
//   phi(x) = relu(x / rms(x)) + 1e-6, S_j = sum_{t in block j} phi(k_t) [v_t, 1]^T   (fp32)
//   P_i    = sum_{j < i} w_ij S_j                       (whole earlier blocks: the prefix)
//   n_t    = phi(q_t) P_i + w_ii sum_{s <= t, s in block i} (phi(q_t) . phi(k_s)) [v_s, 1]
//   o_t    = n_t[:D] / (n_t[D] + 1e-6)                  for t in block i
//
// Weights: linear attention has w = 1 everywhere. MHLA derives them from its learned
// lower-triangular M x M matrix m with the long-sequence policy of src/attention/causal_linear.h:
// w_ij = m_ij for i < M; for i >= M the last row slides, w_ij = m_{M-1, max(0, j - i + M - 1)}, so
// a block past the trained length reads its M - 1 predecessors with their own weights and all
// older history with m_{M-1,0}. The prefix pass therefore costs O(blocks x M) per state element,
// whatever the sequence length.
//
// Six kernels, launched as passes (`passes` selects; the binding runs a GEMM in place of a prefix
// pass where that is cheaper): forward: block states; the prefix (a sweep over blocks per state
// element); the output (prefix product plus the masked intra-block product). Backward: a query
// pass (dq, dP_i, the intra-block parts of dk and dv, dm_ii; it zeroes grad_mixing first), the
// prefix backward (dS_j, and the sliding row's dm past the trained length) and a key pass (dk, dv
// from dS_j plus the intra-block parts). The mixing gradient of the rows inside the trained
// length, dm_ij = sum over batch, heads and elements of dP_i * S_j (j < i < M), is left to the
// caller: a pair-products kernel over the states (src/attention/causal_block_linear_cuda.cpp). Same
// conventions as block_linear_attention.h: raw pointers, [B, T, H, D] views with a contiguous,
// 16-byte aligned last dimension, outputs contiguous, fp32 accumulation, D in {32, 64, 128} (fp32
// inputs: D <= 64), any T.
#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

#include "mhla/block_linear_attention.h"

namespace mhla_kernels {

constexpr int kCausalBlockTokens = 64;

struct CausalBlockLinearShape {
  int batch = 0, tokens = 0, heads = 0, head_dim = 0;
  int mixing_blocks = 1;  // M of the learned matrix; 1 (with mixing == nullptr) for linear
};

// Blocks of one sequence, ceil(T / 64). A set of states (S and z of every batch, head and block)
// is B * H * blocks * (D * D + D) floats, laid out [B * H, blocks, D * D + D].
int causal_blocks(int tokens);

// Whether the kernels take the shape and dtype (the binding runs the reference otherwise).
bool causal_block_linear_supported(const CausalBlockLinearShape& shape, DType dtype);

// A packed set of prefixes: per block the D x D matrix of P_i in bf16, then z_i in fp32, laid out
// [B * H, blocks, D * D / 2 + D] floats. The output and query passes read P only as bf16
// tensor-core tiles and fp32 z, so the fp32 matrix's bytes were wasted; z stays fp32 for the
// mixing gradient's accuracy (session 17: bf16 z missed the op harness's bound). Taken for bf16
// inputs on the lean token passes (MHLA_CAUSAL_LEAN_PASSES, on by default) unless
// MHLA_CAUSAL_PACKED_PREFIX=0.
bool causal_prefix_packed(DType dtype);
// Floats per block of a set of prefixes, packed or not (D * D + D).
int64_t causal_prefix_floats(int head_dim, bool packed);

// Pass selection (bitmasks).
constexpr unsigned kCausalStatesPass = 1, kCausalPrefixPass = 2, kCausalOutputPass = 4;
constexpr unsigned kCausalQueryPass = 1, kCausalKeyPass = 4;  // backward; prefix as above
constexpr unsigned kCausalAllPasses = 7;

struct CausalBlockLinearForward {
  unsigned passes = kCausalAllPasses;
  CausalBlockLinearShape shape;
  DType dtype = DType::bf16;
  TokenTensor q, k, v;
  const float* mixing = nullptr;  // [M, M] fp32 lower triangular, or nullptr (linear attention)
  void* out = nullptr;            // [B, T, H, D] contiguous
  float* states = nullptr;        // a set of states: S_j, kept for the backward pass
  float* prefix = nullptr;        // a set of prefixes: P_i, kept for the backward pass
  bool packed_prefix = false;     // prefix packed (causal_prefix_packed; bf16 only)
  // states as a packed set: S_j in bf16 (the sweeps and the pair products sum it in fp32, the
  // token passes never read it), z_j in fp32. Taken where the prefix is a sweep.
  bool packed_states = false;
};

struct CausalBlockLinearBackward {
  unsigned passes = kCausalAllPasses;
  CausalBlockLinearShape shape;
  DType dtype = DType::bf16;
  TokenTensor q, k, v, out, grad_out;
  const float* mixing = nullptr;
  const float* states = nullptr;  // from the forward pass
  const float* prefix = nullptr;
  bool packed_prefix = false;  // as in the forward pass
  bool packed_states = false;  // as in the forward pass
  // grad_prefix (dP_i, written by the query pass) as a packed set, for the sweeps to read.
  bool packed_grad_prefix = false;
  void* grad_q = nullptr;  // [B, T, H, D] contiguous each
  void* grad_k = nullptr;
  void* grad_v = nullptr;
  float* grad_mixing = nullptr;  // [M, M] fp32, overwritten (summed over batch and heads)
  float* grad_prefix = nullptr;  // a set of states (workspace)
  float* grad_states = nullptr;  // a set of states (workspace)
  // grad_states as a packed set (the layout of a packed prefix set; causal_prefix_packed): the
  // key pass reads dS only as bf16 tiles and fp32 dz. Written so by the prefix sweeps.
  bool packed_grad_states = false;
  // Ordered sums (train.deterministic, src/core/determinism.h): the query pass stores each CTA's
  // part of the diagonal dm_ii here, [batch * heads, blocks], instead of adding it into
  // grad_mixing with an atomic; the caller sums the parts in a fixed order.
  float* diagonal_parts = nullptr;
};

// cudaSuccess or the first launch error; cudaErrorInvalidValue for a shape the kernels do not take.
cudaError_t causal_block_linear_forward(const CausalBlockLinearForward& args, cudaStream_t stream);
cudaError_t causal_block_linear_backward(const CausalBlockLinearBackward& args,
                                         cudaStream_t stream);

}  // namespace mhla_kernels
