#pragma once
// Bidirectional linear attention on the GPU, forward and backward:
//   o_t = phi(q_t) S / (phi(q_t) z + 1e-6),  S = sum_t phi(k_t) v_t^T,  z = sum_t phi(k_t),
//   phi(x) = relu(x / rms(x)) + 1e-6.
// It is the one-block, no-mixing case of block linear attention (kernels/mhla): the same fused
// kernels run with M = 1 and the mixing passes skipped. Same conventions (raw pointers, strides in
// elements, [B, N, H, D], D in {32, 64, 128}, fp32/fp16/bf16).
#include "mhla/block_linear_attention.h"

namespace mhla_kernels {

struct LinearAttentionForward {
  int batch = 0, tokens = 0, heads = 0, head_dim = 0;
  DType dtype = DType::bf16;
  TokenTensor q, k, v;
  void* out = nullptr;     // [B, N, H, D] contiguous
  float* state = nullptr;  // linear_attention_state_floats(): S and z per batch and head
  // Ordered sums over the 256-token chunks (train.deterministic): block_linear_chunk_parts_floats
  // of the one-block shape, or nullptr for atomic adds (BlockLinearForward::chunk_parts).
  float* chunk_parts = nullptr;
  // Where linear_attention_packs_states: linear_attention_packed_floats for a packed copy of S
  // (pack_state_set.h), which the output pass (and the backward's query pass) read; nullptr to
  // read the fp32 set.
  float* packed_state = nullptr;
};

struct LinearAttentionBackward {
  int batch = 0, tokens = 0, heads = 0, head_dim = 0;
  DType dtype = DType::bf16;
  TokenTensor q, k, v, out, grad_out;
  const float* state = nullptr;  // from the forward pass
  void* grad_q = nullptr;
  void* grad_k = nullptr;
  void* grad_v = nullptr;
  float* grad_state = nullptr;   // workspace, linear_attention_state_floats()
  float* chunk_parts = nullptr;  // as in LinearAttentionForward
  // The forward's packed copy of S (or nullptr, then both are ignored), and room for a packed
  // copy of dS (linear_attention_packed_floats) that the key pass reads.
  const float* packed_state = nullptr;
  float* packed_grad_state = nullptr;
};

size_t linear_attention_state_floats(int batch, int heads, int head_dim);
size_t linear_attention_packed_floats(int batch, int heads, int head_dim);
// Whether the passes would read packed copies of S and dS for these inputs: bf16 on the
// fragment passes, with sequences longer than one tile (their pipelined chunk forms).
bool linear_attention_packs_states(int tokens, int head_dim, DType dtype);
cudaError_t linear_attention_forward(const LinearAttentionForward& args, cudaStream_t stream);
cudaError_t linear_attention_backward(const LinearAttentionBackward& args, cudaStream_t stream);

}  // namespace mhla_kernels
