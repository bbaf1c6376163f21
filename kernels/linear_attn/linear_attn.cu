#include "linear_attn/linear_attn.h"

#include "mhla/block_fragment_passes.h"
#include "mhla/pack_state_set.h"

namespace mhla_kernels {

size_t linear_attention_state_floats(int batch, int heads, int head_dim) {
  return block_linear_state_floats({batch, 1, heads, head_dim, 1});
}

size_t linear_attention_packed_floats(int batch, int heads, int head_dim) {
  return block_linear_packed_floats({batch, 1, heads, head_dim, 1});
}

bool linear_attention_packs_states(int tokens, int head_dim, DType dtype) {
  return fragment_passes_in_use(dtype, head_dim) &&
         fragment_chunk_pipelined({1, tokens, 1, head_dim, 1}, dtype);
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
  if (a.packed_state == nullptr) return block_linear_forward(block, stream);
  // S, packed, then the output pass on the packed copy.
  block.passes = kBlockStatesPass;
  cudaError_t err = block_linear_forward(block, stream);
  if (err != cudaSuccess) return err;
  const int64_t states = static_cast<int64_t>(a.batch) * a.heads;
  if ((err = pack_state_set(a.state, a.packed_state, states, a.head_dim, stream)) != cudaSuccess)
    return err;
  block.passes = kBlockOutputPass;
  block.mixed = a.packed_state;
  block.packed_mixed = true;
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
  if (a.packed_state == nullptr || a.packed_grad_state == nullptr)
    return block_linear_backward(block, stream);
  // The query pass on the packed S, dS packed, the key pass on it.
  block.passes = kBlockQueryPass;
  block.mixed = a.packed_state;
  block.packed_mixed = true;
  cudaError_t err = block_linear_backward(block, stream);
  if (err != cudaSuccess) return err;
  const int64_t states = static_cast<int64_t>(a.batch) * a.heads;
  if ((err = pack_state_set(a.grad_state, a.packed_grad_state, states, a.head_dim, stream)) !=
      cudaSuccess)
    return err;
  block.passes = kBlockKeyPass;
  block.grad_states = a.packed_grad_state;
  block.packed_grad_states = true;
  return block_linear_backward(block, stream);
}

}  // namespace mhla_kernels
