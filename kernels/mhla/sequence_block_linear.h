#pragma once
// Bidirectional block linear attention (plain linear attention and MHLA) with one CTA per
// (batch, head) and all M block states of that sequence in shared memory (bf16 tensor-core tiles,
// fp32 normalizers), so no state goes through global memory in the forward pass.
//
// Forward, per (batch, head): S_j = phi(K_j)^T [V_j, 1] for every block j (fp32 accumulation,
// stored as bf16/fp16 tiles), then for every block i the mixed state S'_i = sum_j m_ij S_j is
// formed in shared memory just before block i's outputs. Backward: the states again, then per
// block i the query tiles (dq, dS'_i, dz'_i) with dm_ij = <dS'_i, S_j> taken while S_j is at
// hand; dS'_i goes to a global scratch (fp32, read back once, mostly from L2); dS_j =
// sum_i m_ij dS'_i replaces the states in shared memory; then the key tiles (dk, dv).
// Persistent CTAs, one per multiprocessor, walk the (batch, head) items; each item's first tiles
// are loaded while the previous item finishes.
//
// The state kernels (block_linear_attention.h) move every state set through global memory: at
// 64-token blocks and D = 64 the fp32 states weigh as much as the keys and values. Here the state
// traffic is the backward's scratch only. The cost: the states are rounded to bf16 before the
// mixing (the state kernels mix in fp32 and round after), and the grid holds one CTA per
// (batch, head), so few (batch, head) items leave multiprocessors idle.
//
// Takes bf16 or fp16, D in {32, 64}, N % M == 0, and M block states that fit in shared memory
// (M <= 16 at D = 64, M <= 64 at D = 32). Views and outputs as in block_linear_attention.h.
#include "mhla/block_linear_attention.h"

namespace mhla_kernels {

struct SequenceBlockLinearForward {
  BlockLinearShape shape;
  DType dtype = DType::bf16;
  TokenTensor q, k, v;
  const float* mixing = nullptr;  // [M, M] fp32, or nullptr (linear attention, M = 1)
  void* out = nullptr;            // [B, N, H, D] contiguous
};

struct SequenceBlockLinearBackward {
  BlockLinearShape shape;
  DType dtype = DType::bf16;
  TokenTensor q, k, v, grad_out;
  const float* mixing = nullptr;
  void* grad_q = nullptr;  // [B, N, H, D] contiguous each
  void* grad_k = nullptr;
  void* grad_v = nullptr;
  float* grad_mixing = nullptr;  // [M, M] fp32, overwritten (summed over batch and heads)
  float* scratch = nullptr;      // sequence_block_linear_scratch_floats(shape) floats
};

bool sequence_block_linear_supported(const BlockLinearShape& shape, DType dtype);
size_t sequence_block_linear_scratch_floats(const BlockLinearShape& shape);
cudaError_t sequence_block_linear_forward(const SequenceBlockLinearForward& args,
                                          cudaStream_t stream);
cudaError_t sequence_block_linear_backward(const SequenceBlockLinearBackward& args,
                                           cudaStream_t stream);

}  // namespace mhla_kernels
