#pragma once
// Four passes of the bidirectional block-linear kernels (block_linear_attention.h) on mma.sync
// fragments, for 16-bit inputs and D in {32, 64}: the states, output, query and key passes. Same
// grid as the WMMA kernels (one CTA per batch*head, block and chunk of 256 tokens) and the same
// results up to rounding; block_linear_attention.cu takes them where they apply.
//   states : S_j += phi(K)^T V, z_j += sum phi(k)                          per block
//   output : o = phi(q) S'_i / (phi(q) . z'_i + eps)                       per token
//   query  : dnum = dO / den, dden = -(dO . o) / den;
//            dq = phi'(q)^T (dnum S'^T + dden z'^T)                        per token
//            dS'_i += phi(Q)^T dnum, dz'_i += phi(Q)^T dden                per block
//   key    : dv = phi(K) dS_j, dk = phi'(k)^T (V dS_j^T + dz_j)            per token
// Why: the WMMA kernels summed a row's normalizer and the normalizer gradient's columns in
// loops of 64 steps on single threads, staged every product through fp32 shared memory and took
// up to five barriers per tile (the query pass: 196 us at B = 64, N = 1,024, H = 6, D = 64 on
// the H200, four times the time its bytes take). Here two lanes own each token row for its sums
// (one shuffle), products stay in the accumulators for what follows them, dz' is one more
// column of the dnum product (z one more column of V's), and only the state products (states
// and query passes) take a barrier per tile. The query pass does not read o: dO . o is
// phi(q) . (dnum S'^T), from the d(phi) product it computes anyway. With packed_mixed /
// packed_grad_states (bf16 only) the passes read S' and dS as bf16 matrices.
#include "mhla/block_linear_attention.h"

namespace mhla_kernels {

// Whether the fragment passes take this input type and head dimension.
bool fragment_passes_supported(DType dtype, int head_dim);

// Whether block_linear_forward / block_linear_backward run all four passes on fragments for this
// input type and head dimension (supported, and not switched off by MHLA_FRAGMENT_PASSES).
bool fragment_passes_in_use(DType dtype, int head_dim);

// Whether every CTA of the passes' grid covers one 64-token tile at most (blocks of <= 64 tokens:
// MHLA at N = 1,024 in 16 blocks); then the states and output passes take their one-tile
// variants, which keep no second tile buffer and cap their registers for more CTAs per SM.
// MHLA_FRAGMENT_ONE_TILE=0 keeps the general variants (A/B runs).
bool fragment_one_tile_variants(const BlockLinearShape& shape);

// Whether the four passes take their pipelined one-tile variants (fragment_pipeline.cuh): bf16
// inputs, one chunk per block and blocks of at most one tile; each pass also needs its packed
// state sets. MHLA_PIPELINED_PASSES=0 keeps the one-shot CTAs (A/B runs).
bool fragment_pipelined_variants(const BlockLinearShape& shape, DType dtype, int chunks);

// Whether the four passes take the chunk form of the pipelined variants (fragment_pipeline.cuh's
// chunk walk): bf16 inputs and blocks longer than one tile; each pass also needs the packed sets
// it reads (the states and query passes write fp32 sums where chunks share a state).
// MHLA_PIPELINED_CHUNKS=0 keeps the one-shot CTAs (A/B runs).
bool fragment_chunk_pipelined(const BlockLinearShape& shape, DType dtype);

// Each launches its pass over `chunks` chunks per block; with more than one chunk per block the
// states and query passes add into their state set, which must then be zero on entry.
cudaError_t fragment_states(const BlockLinearForward& args, int chunks, cudaStream_t stream);
cudaError_t fragment_output(const BlockLinearForward& args, int chunks, cudaStream_t stream);
cudaError_t fragment_query_backward(const BlockLinearBackward& args, int chunks,
                                    cudaStream_t stream);
cudaError_t fragment_key_backward(const BlockLinearBackward& args, int chunks, cudaStream_t stream);

}  // namespace mhla_kernels
