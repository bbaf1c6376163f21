#pragma once
// Block linear attention in its dense masked form, for short sequences: instead of D x (D + 1)
// block states, the N x N scores
//
//   P_ts = (phi(q_t) . phi(k_s)) w(t, s),   w(t, s) = m_{block(t), block(s)} (1 without mixing)
//   o_t  = sum_s P_ts v_s / (sum_s P_ts + 1e-6)
//
// which equals the state form exactly (sum_j m_ij S_j read by phi(q_t)) but never stores a state:
// flash-attention-style 64 x 64 tiles on tensor cores, no softmax, fp32 accumulation. Costs
// O(N^2 D) instead of O(N D^2 + M^2 D^2), so it pays off where blocks are short (N = 256 with
// 16 blocks: 16-token blocks whose fp32 states outweigh the tokens).
//
// Forward writes o and the row sums den_t = sum_s P_ts. The backward takes g_t = do_t /
// (den_t + eps) and gd_t = -(do_t . o_t) / (den_t + eps) (cheap elementwise, computed by the
// caller) and runs two kernels without atomics on q/k/v: per key tile (dk, dv, and dm reduced
// over batch and heads in fp32) and per query tile (dq):
//   dP_ts = g_t . v_s + gd_t,  dA = dP o w,  dphi(q) = dA phi(K),  dphi(k) = dA^T phi(Q),
//   dv = P^T g,  dm_ij = sum_{t in i, s in j} dP_ts (phi(q_t) . phi(k_s)).
// Causal mode (language models): blocks are 64 tokens (the last one may be partial),
// shape.blocks = ceil(N / 64), the mixing matrix is the expanded lower-triangular one
// (attention/causal_linear.h), and w(t, s) = 0 for s > t; score tiles above the diagonal are
// skipped.
// Same conventions as block_linear_attention.h (views, dtypes, feature map, contiguous outputs).
#include "mhla/block_linear_attention.h"

namespace mhla_kernels {

struct DenseBlockLinearForward {
  BlockLinearShape shape;
  DType dtype = DType::bf16;
  TokenTensor q, k, v;
  const float* mixing = nullptr;  // [M, M] fp32, or nullptr (linear attention)
  bool causal = false;
  void* out = nullptr;            // [B, N, H, D] contiguous
  float* den = nullptr;           // [B * H, N] fp32: sum_s P_ts
};

struct DenseBlockLinearBackward {
  BlockLinearShape shape;
  DType dtype = DType::bf16;
  TokenTensor q, k, v;
  TokenTensor grad_scaled;        // g = do / (den + eps), [B, N, H, D] in the input dtype
  const float* grad_den = nullptr;  // gd = -(do . o) / (den + eps), [B * H, N] fp32
  const float* mixing = nullptr;
  bool causal = false;
  void* grad_q = nullptr;         // [B, N, H, D] contiguous
  void* grad_k = nullptr;
  void* grad_v = nullptr;
  float* grad_mixing = nullptr;   // [M, M] fp32 (zeroed here), when mixing is given
};

constexpr int kDenseCausalBlock = 64;

// Whether the dense kernels take this shape and dtype (head dims 32, 64, 128; M <= 64 dividing
// N, or causal with M = ceil(N / 64) <= 64; the tiles of the dtype fit in shared memory).
bool dense_block_linear_supported(const BlockLinearShape& shape, DType dtype, bool causal);
cudaError_t dense_block_linear_forward(const DenseBlockLinearForward& args, cudaStream_t stream);
cudaError_t dense_block_linear_backward(const DenseBlockLinearBackward& args, cudaStream_t stream);

}  // namespace mhla_kernels
