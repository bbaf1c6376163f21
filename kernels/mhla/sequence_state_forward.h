#pragma once
// MHLA's forward in one kernel for sequences of at most 16 blocks of 64 tokens (N = 64 M, head
// dim 64, bf16). The state kernels (block_linear_attention.h) run it as three passes, states ->
// state mix -> output, and the block states S and S' make two round trips through DRAM between
// them; at M = 16 blocks of 64 tokens the states are as many bytes as the keys and values they
// summarize. Here one persistent CTA per (batch, head) at a time
//
//   S_j  = phi(K_j)^T [V_j, 1]          (mma.sync, fp32, rounded to bf16 in shared memory)
//   S'_i = sum_j m_ij S_j               (in shared memory, m as bf16 high and low parts)
//   o_t  = phi(q_t) S'_i / (phi(q_t) z'_i + eps)   (t in block i)
//
// with the token tiles brought by the tensor copy engine into a ring that a producer warp keeps
// full. S and S' still leave as packed sets (block_linear_attention.h: D x D bf16, then D fp32),
// for the backward passes that read them (query pass, mix backward).
#include "mhla/block_linear_attention.h"

namespace mhla_kernels {

struct SequenceStateForward {
  BlockLinearShape shape;
  DType dtype = DType::bf16;
  TokenTensor q, k, v;
  const float* mixing = nullptr;  // [M, M] fp32
  void* out = nullptr;            // [B, N, H, D] contiguous
  float* states = nullptr;        // packed set (block_linear_packed_floats): S_j and z_j
  float* mixed = nullptr;         // packed set: S'_i and z'_i
};

// The shapes the kernel computes: bf16, head dim 64, N = 64 M with 1 <= M <= 16.
bool sequence_state_forward_supported(const BlockLinearShape& shape, DType dtype);
// The shape, and views and outputs the tensor copy engine can read and write (16-byte aligned
// bases and strides).
bool sequence_state_forward_takes(const SequenceStateForward& args);
// cudaErrorInvalidValue for arguments it does not take.
cudaError_t sequence_state_forward(const SequenceStateForward& args, cudaStream_t stream);

}  // namespace mhla_kernels
