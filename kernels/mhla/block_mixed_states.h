#pragma once
// Bidirectional MHLA's block states and their mix in one pass over the keys and values:
//   S_j  = phi(K_j)^T V_j,  z_j = sum phi(k) over block j      (written: the backward's dm needs them)
//   S'_i = sum_j m_ij S_j,  z'_i = sum_j m_ij z_j               (written: the output pass reads them)
// Why: as two kernels (the states pass, then block_state_mix) the fp32 states S were written and
// read back once more only to be mixed: at B = 64, N = 1,024, H = 6, D = 64, M = 16 that is
// 100 MB each way, about 60 us on the H200. Here each CTA walks every block of one (batch, head)
// for a slice of the value columns, keeps its slice of all M mixed states in registers and adds
// m_ij S_j into them as each block ends. Same state layout as block_linear_attention.h.
#include "mhla/block_linear_attention.h"

namespace mhla_kernels {

constexpr int kMixedStatesMaxBlocks = 16;

struct BlockMixedStates {
  BlockLinearShape shape;  // blocks in [1, kMixedStatesMaxBlocks]
  DType dtype = DType::bf16;
  TokenTensor k, v;
  const float* mixing = nullptr;  // [M, M] fp32 row-major, on the device
  float* states = nullptr;        // block_linear_state_floats(shape): S_j, z_j (written)
  float* mixed = nullptr;         // same size: S'_i, z'_i (written)
};

// Whether the kernel takes this dtype and shape: 16-bit inputs, D in {32, 64}, at most
// kMixedStatesMaxBlocks blocks, B * H <= 65535.
bool block_mixed_states_supported(const BlockLinearShape& shape, DType dtype);

// CTAs the kernel launches for this shape (one per (batch, head) and column slice): callers
// compare it with the multiprocessors to decide whether the pass has parallelism enough.
int block_mixed_states_ctas(const BlockLinearShape& shape);

// cudaErrorInvalidValue for what block_mixed_states_supported refuses.
cudaError_t block_mixed_states(const BlockMixedStates& args, cudaStream_t stream);

}  // namespace mhla_kernels
