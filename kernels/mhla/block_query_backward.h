#pragma once
// The query pass of the bidirectional block-linear backward (block_linear_attention.h) on
// mma.sync fragments, for 16-bit inputs and D in {32, 64}:
//   dnum = dO / den,  dden = -(dO . o) / den              per token (den = phi(q) . z' + eps)
//   dq   = phi'(q)^T (dnum S'^T + dden z'^T)               per token
//   dS'  += phi(Q)^T dnum,  dz' += phi(Q)^T dden            per (batch*head, block)
// Why a second form: the WMMA kernel of block_linear_attention.cu computed den and dz' in
// 64-step loops over a tile's rows on single threads, staged d(phi) through fp32 shared memory
// and took five barriers per tile (196 us at B = 64, N = 1,024, H = 6, D = 64 on the H200, four
// times the time its bytes take). Here two lanes own each token row for the row sums, den and
// dden come from those lanes, dz' is the product with dden as one more column of dnum, d(phi)
// stays in the accumulators for the feature backward, and a tile takes one barrier.
#include "mhla/block_linear_attention.h"

namespace mhla_kernels {

// Whether the fragment form takes this input type and head dimension.
bool fragment_query_backward_supported(DType dtype, int head_dim);

// One CTA per (batch*head, block, chunk of 256 tokens), the grid of the other passes; with more
// than one chunk per block, grad_mixed must be zero on entry (the chunks add into it).
cudaError_t fragment_query_backward(const BlockLinearBackward& args, int chunks,
                                    cudaStream_t stream);

}  // namespace mhla_kernels
