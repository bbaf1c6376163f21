#pragma once
// The backward pass of bidirectional MHLA's state mix S'_i = sum_j m_ij S_j in one pass over the
// fp32 block states, for up to 32 blocks (bidirectional MHLA's usual 4 x 4 grid of blocks; the
// causal prefix P_i = sum_{j<i} w_ij S_j up to 2,048 tokens, with w strictly lower):
//   dS_j  = sum_i m_ij dS'_i                       (written)
//   dm_ij += sum over batch*head and elements of dS'_i * S_j   (added to grad_mixing)
// Why one pass: as two kernels (block_state_mix with the transposed matrix, then
// block_pair_products) dS' was read twice, and the pair products ran three bf16 tensor-core
// products per term to keep fp32 accuracy; here each thread keeps a 4 x 16 corner of dm and the
// four output rows of its group in registers over one 4-element column of the states, in fp32.
#include <cstdint>

#include <cuda_runtime.h>

namespace mhla_kernels {

constexpr int kMixBackwardMaxBlocks = 32;

struct BlockMixBackward {
  const float* grad_mixed = nullptr;  // dS' [batch_heads, blocks, elements]
  const float* states = nullptr;      // S, same layout
  const float* mixing = nullptr;      // m [blocks, blocks] row-major, on the device
  float* grad_states = nullptr;       // dS, same layout as the states (written)
  float* grad_mixing = nullptr;       // [blocks, blocks]: the products are ADDED (zero it first)
  int batch_heads = 0, blocks = 0;    // 1 <= blocks <= kMixBackwardMaxBlocks
  int64_t elements = 0;               // per state; a multiple of 4, 16-byte aligned rows
  // > 0: grad_states is a packed set: the first packed_matrix elements of each state (a multiple
  // of 8) in bf16, the rest fp32, states of packed_matrix / 2 + elements - packed_matrix floats
  // (what block_state_mix writes with the same setting).
  int64_t packed_matrix = 0;
  // > 0: grad_mixed and states are packed sets the same way (equal to packed_matrix; see
  // block_mix_backward_takes_packed): the bidirectional MHLA binding at one chunk per block
  // (block_linear_attention.h, packed_states, packed_grad_mixed). Their bf16 matrix part runs on
  // tensor cores, the fp32 rest as above.
  int64_t packed_inputs_matrix = 0;
  // Deterministic mode: [block_mix_backward_parts(args), blocks, blocks] fp32. CTA c writes its
  // sums (over its batch*heads and elements) into part c, every element, instead of adding them
  // into grad_mixing with atomics, whose order changes from run to run; the caller sums the
  // parts in a fixed order. grad_mixing is then not touched.
  float* grad_mixing_parts = nullptr;
};

// How many CTAs (so parts) a call with these arguments runs: 0 with nothing to do, -1 when the
// kernel cannot be configured on this GPU.
int64_t block_mix_backward_parts(const BlockMixBackward& args);

// Whether the fused pass takes these sizes (otherwise: block_state_mix + block_pair_products).
bool block_mix_backward_supported(int blocks, int64_t elements);
// Whether it takes packed inputs of this matrix part (0: fp32 inputs, always): up to 16 blocks
// and a matrix part of a multiple of 512 elements (the tensor-core kernel's items).
bool block_mix_backward_takes_packed(int blocks, int64_t packed_inputs_matrix);

// cudaErrorInvalidValue for sizes out of range.
cudaError_t block_mix_backward(const BlockMixBackward& args, cudaStream_t stream);

}  // namespace mhla_kernels
