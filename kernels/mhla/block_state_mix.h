#pragma once
// Mixing fp32 block states by a small matrix: out[b, i] = sum_j w_ij in[b, j] for every
// batch*head b and block i < blocks, each state a row of `elements` floats, laid out
// [batch*head, blocks, elements]. MHLA's S'_i = sum_j m_ij S_j (bidirectional), its causal prefix
// P_i = sum_{j<i} w_ij S_j, and their transposes in the backward pass.
//
// cuBLAS runs this as a batched GEMM with a broadcast 16 x 16 operand through a SIMT kernel at a
// quarter of the copy bandwidth; here each thread owns four consecutive elements of every block
// state, issues all its loads before the products, and reads the weights from shared memory.
// Triangular weights skip the blocks whose weights are zero.
#include <cstdint>

#include <cuda_runtime.h>

namespace mhla_kernels {

enum class MixPattern {
  dense,
  lower,  // w_ij = 0 for j >= i (the causal prefix)
  upper,  // w_ij = 0 for j <= i (its transpose)
};

struct BlockStateMix {
  const float* in = nullptr;        // [batch_heads, blocks, elements]
  const float* weights = nullptr;   // [blocks, blocks] row-major, on the device
  float* out = nullptr;             // [batch_heads, blocks, elements], not aliasing `in`
  int batch_heads = 0, blocks = 0;  // blocks <= kMaxMixBlocks
  int64_t elements = 0;             // a multiple of 4; rows 16-byte aligned
  MixPattern pattern = MixPattern::dense;
  // > 0: `out` is a packed set of causal prefixes (causal_block_linear.h, causal_prefix_packed):
  // the first packed_matrix elements of each row (D * D, a multiple of 8) in bf16, the rest fp32,
  // rows of packed_matrix / 2 + elements - packed_matrix floats.
  int64_t packed_matrix = 0;
  // `in` is a packed set the same way (packed_matrix > 0 required): the bidirectional MHLA
  // binding's block states at one chunk per block (block_linear_attention.h, packed_states).
  bool packed_in = false;
};

constexpr int kMaxMixBlocks = 128;

// cudaErrorInvalidValue for sizes out of range.
cudaError_t block_state_mix(const BlockStateMix& args, cudaStream_t stream);

}  // namespace mhla_kernels
