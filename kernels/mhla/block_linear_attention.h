#pragma once
// Bidirectional block linear attention on the GPU: linear attention (one block, no mixing) and
// MHLA (M contiguous token blocks mixed by an M x M matrix), forward and backward.
//
//   phi(x) = relu(x / rms(x)) + 1e-6                     (per token and head, over D)
//   S_j    = sum_{t in block j} phi(k_t) [v_t, 1]^T      (fp32, D x (D + 1): state and normalizer)
//   S'_i   = sum_j m_ij S_j                              (skipped when there is no mixing)
//   o_t    = (phi(q_t) S'_i)[:D] / ((phi(q_t) S'_i)[D] + 1e-6)   for t in block i
//
// Plain CUDA: raw device pointers, sizes, strides (in elements) and a stream. q, k, v are
// [B, N, H, D] views whose last dimension is contiguous and whose rows start 16-byte aligned;
// outputs and gradients are written contiguous [B, N, H, D]. Inputs fp32, fp16 or bf16; tensor-core
// products (tf32 for fp32 inputs) with fp32 accumulation; D in {32, 64, 128}; N % blocks == 0.
#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

namespace mhla_kernels {

enum class DType { f32, f16, bf16 };

struct TokenTensor {  // a [B, N, H, D] view
  const void* data = nullptr;
  int64_t batch_stride = 0, token_stride = 0, head_stride = 0;
};

struct BlockLinearShape {
  int batch = 0, tokens = 0, heads = 0, head_dim = 0;
  int blocks = 1;  // M; 1 with mixing == nullptr is plain linear attention
};

// Floats of one set of states (S and z for every batch, head and block): B * H * M * (D*D + D).
size_t block_linear_state_floats(const BlockLinearShape& shape);
// Floats of a packed set: per state D * D bf16 then D fp32, B * H * M * (D*D / 2 + D).
size_t block_linear_packed_floats(const BlockLinearShape& shape);
// Whether the states pass can write (and the query pass its dS') a packed set of states: bf16
// inputs on the fragment passes, one 256-token chunk per block.
bool block_states_packable(const BlockLinearShape& shape, DType dtype);
// Whether a block is longer than one 256-token chunk, so that several CTAs add into its state
// (and, backward, into its dS') with atomics, whose results differ in their last bits from run
// to run, unless the caller gives them chunk_parts (BlockLinearForward) to sum in order.
bool block_states_shared_by_chunks(const BlockLinearShape& shape);
// Floats of the workspace for ordered state sums (chunk_parts below): one state set per chunk,
// then the column-sum kernel's workspace; 0 where one chunk covers each block.
size_t block_linear_chunk_parts_floats(const BlockLinearShape& shape);

// Pass selection (bitmasks): a caller that mixes the states itself (the MHLA binding, by its
// state-mix kernel) runs the states and output passes (forward) or the query and key passes
// (backward) around its own.
constexpr unsigned kBlockStatesPass = 1, kBlockMixPass = 2, kBlockOutputPass = 4;
constexpr unsigned kBlockQueryPass = 1, kBlockKeyPass = 4;  // backward; mixing as above
constexpr unsigned kBlockAllPasses = 7;

struct BlockLinearForward {
  unsigned passes = kBlockAllPasses;
  BlockLinearShape shape;
  DType dtype = DType::bf16;
  TokenTensor q, k, v;
  const float* mixing = nullptr;  // [M, M] fp32, or nullptr (identity; requires M == 1)
  void* out = nullptr;            // [B, N, H, D] contiguous
  float* states = nullptr;        // state_floats: S_j, kept for the backward pass
  float* mixed = nullptr;         // state_floats: S'_i (may equal states when mixing is null)
  // mixed is a packed set (block_linear_packed_floats): each S'_i as D * D bf16, then z'_i fp32.
  // The passes round S' to bf16 anyway, so the output is the same; bf16 inputs whose passes
  // all run on fragments only (block_fragment_passes.h: fragment_passes_in_use).
  bool packed_mixed = false;
  // states is a packed set the same way, for a caller that mixes the states itself (passes
  // without kBlockMixPass): bf16 inputs whose states pass runs on fragments, one chunk per block
  // (one CTA owns each state; block_states_packable). Its mixing (block_state_mix) and the mixing
  // backward (block_mix_backward) read the packed set.
  bool packed_states = false;
  // Chunks sharing a state add into it one element per atomic instead of four (fragment passes;
  // set from MHLA_SCALAR_STATE_ADDS=1 by block_linear_forward, for A/B runs).
  bool scalar_state_adds = false;
  // The pipelined states pass (fragment_pipeline.cuh) stores a packed S straight from its
  // accumulators instead of in 16-byte pieces through shared memory (set from
  // MHLA_PACKED_STATE_STORES=direct, for A/B runs; the one-shot states pass always stores
  // straight).
  bool direct_packed_stores = false;
  // Ordered sums (train.deterministic, src/core/determinism.h) where chunks share a state: each
  // chunk's CTA stores its part into set `chunk` of this workspace
  // (block_linear_chunk_parts_floats) and the parts are summed in chunk order into `states`,
  // instead of atomic adds whose order changes from run to run.
  float* chunk_parts = nullptr;
};

struct BlockLinearBackward {
  unsigned passes = kBlockAllPasses;
  BlockLinearShape shape;
  DType dtype = DType::bf16;
  TokenTensor q, k, v, out, grad_out;
  const float* mixing = nullptr;
  const float* states = nullptr;  // from the forward pass
  const float* mixed = nullptr;
  void* grad_q = nullptr;  // [B, N, H, D] contiguous each
  void* grad_k = nullptr;
  void* grad_v = nullptr;
  float* grad_mixing = nullptr;     // [M, M] fp32, overwritten (summed over batch and heads)
  float* grad_mixed = nullptr;      // workspace, state_floats
  float* grad_states = nullptr;     // workspace, state_floats (may equal grad_mixed without mixing)
  bool packed_mixed = false;        // as in BlockLinearForward
  bool packed_grad_states = false;  // grad_states packed the same way (the key pass reads it)
  // The query pass writes grad_mixed (dS') as a packed set: same conditions as packed_states
  // (one CTA owns each state), for the mixing backward that reads S and dS' packed.
  bool packed_grad_mixed = false;
  bool scalar_state_adds = false;     // as in BlockLinearForward
  bool direct_packed_stores = false;  // as in BlockLinearForward (the query pass's dS')
  // The query pass zeroes these floats (the mix backward's dm, which that kernel adds into): a
  // fill kernel between the two would break their dependent launch (common/dependent_launch.cuh).
  float* zero_on_entry = nullptr;
  int zero_floats = 0;
  float* chunk_parts = nullptr;  // as in BlockLinearForward, for dS' (grad_mixed)
};

// Return cudaSuccess or the first launch error; a shape the kernels do not cover returns
// cudaErrorInvalidValue (the binding checks shapes first and reports them in words).
cudaError_t block_linear_forward(const BlockLinearForward& args, cudaStream_t stream);
cudaError_t block_linear_backward(const BlockLinearBackward& args, cudaStream_t stream);

}  // namespace mhla_kernels
