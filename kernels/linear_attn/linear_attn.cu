#include "linear_attn/linear_attn.h"

namespace mhla_kernels {

size_t linear_attention_state_floats(int batch, int heads, int head_dim) {
  return block_linear_state_floats({batch, 1, heads, head_dim, 1});
}

cudaError_t linear_attention_forward(const LinearAttentionForward& a, cudaStream_t stream) {
  BlockLinearForward block;
  block.shape = {a.batch, a.tokens, a.heads, a.head_dim, 1};
  block.dtype = a.dtype;
  block.q = a.q;
  block.k = a.k;
  block.v = a.v;
  block.out = a.out;
  block.states = a.state;
  block.mixed = a.state;  // no mixing: the output pass reads S directly
  block.chunk_parts = a.chunk_parts;
  return block_linear_forward(block, stream);
}

cudaError_t linear_attention_backward(const LinearAttentionBackward& a, cudaStream_t stream) {
  BlockLinearBackward block;
  block.shape = {a.batch, a.tokens, a.heads, a.head_dim, 1};
  block.dtype = a.dtype;
  block.q = a.q;
  block.k = a.k;
  block.v = a.v;
  block.out = a.out;
  block.grad_out = a.grad_out;
  block.states = a.state;
  block.mixed = a.state;
  block.grad_q = a.grad_q;
  block.grad_k = a.grad_k;
  block.grad_v = a.grad_v;
  block.grad_mixed = a.grad_state;
  block.grad_states = a.grad_state;  // dS = dS' without mixing
  block.chunk_parts = a.chunk_parts;
  return block_linear_backward(block, stream);
}

}  // namespace mhla_kernels
