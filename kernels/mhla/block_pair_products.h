#pragma once
// The mixing-matrix gradient of block linear attention: G_ij = sum over batch*head and state
// elements of X_i * Y_j, for two sets of fp32 block states X (the gradient of the mixed states or
// prefixes) and Y (the block states), each laid out [batch*head, blocks, elements].
//
// A skinny contraction (G is at most 64 x 64; the summed dimension is batch*head*elements, often
// millions): cuBLAS runs it as a strided-batched GEMV at a third of the copy bandwidth, so it has
// a kernel of its own. The tensor cores sum the products from bf16 high and low parts of the fp32
// inputs (2^-17 relative per term), and each CTA adds its sum into G atomically once (or writes it
// as a part, for ordered sums). Up to 32
// rows, each warp loads its own (batch*head, 512-element chunk) items straight into mma.sync
// fragments; from 33 rows, persistent CTAs stage (batch*head, 128-element column) items in shared
// memory and each warp keeps its 16 x 16 tiles of G in registers.
#include <cstdint>

#include <cuda_runtime.h>

namespace mhla_kernels {

struct BlockPairProducts {
  const float* x = nullptr;  // [batch_heads, blocks, elements]
  const float* y = nullptr;  // same layout
  int batch_heads = 0, blocks = 0;
  int rows = 0;          // G covers blocks i, j < rows (1..64, rows <= blocks)
  int64_t elements = 0;  // per block state; a multiple of 4, 16-byte aligned rows
  // Packed sets (both x and y; see mhla/causal_block_linear.h): the first packed_matrix elements
  // of each block are bf16, the rest fp32, a block taking packed_matrix / 2 + (elements -
  // packed_matrix) floats. 0: plain fp32. A multiple of 8.
  int64_t packed_matrix = 0;
  float* grad = nullptr;  // [rows, rows] fp32: the products are ADDED (zero it first)
  // Ordered sums (train.deterministic): when set, [parts, rows, rows] fp32 with
  // block_pair_products_parts(args) parts, each written whole by one CTA or warp (no atomics),
  // for the caller to sum in a fixed order; grad is then not touched.
  float* grad_parts = nullptr;
};

// How many parts a launch with these arguments writes (the grid depends on the GPU); -1 for
// sizes out of range.
int64_t block_pair_products_parts(const BlockPairProducts& args);

// cudaErrorInvalidValue for sizes out of range.
cudaError_t block_pair_products(const BlockPairProducts& args, cudaStream_t stream);

}  // namespace mhla_kernels
