#pragma once
// Pipelined one-tile variants of the token passes (block_fragment_passes.h): where every block is
// at most one 64-token tile and the states are packed (bf16), persistent CTAs walk the
// (batch*head, block) items and copy the next item's token tiles and packed state into a second
// stage of shared memory (cp.async) while they compute the current one.
//
// Why: with one tile per CTA the one-shot passes load, then compute, then store; when the CTAs of
// an SM all compute, no load is in flight. Session 26's SASS profile at N = 1,024 put 22 % (query)
// and 28 % (key) of the stall samples on the wait for the rows' global loads, and prefetching into
// registers instead spilled (session 26, "the query pass on pairs of blocks"). cp.async keeps the
// bytes in flight in shared memory, not registers.
//
// Each item takes one barrier after its copies have landed (which also tells every warp that the
// previous item is done, so the next item's copies may refill that stage), plus one per state
// product (states and query passes) and one before a packed state is staged (states pass).
#include <cuda_bf16.h>

#include "common/async_copy.cuh"
#include "mhla/block_linear_attention.h"
#include "mhla/fragment_rows.cuh"
#include "mhla/tiles.cuh"

namespace mhla_kernels {
namespace fragment_pipeline {

using Element = __nv_bfloat16;  // packed states exist for bf16 inputs only

// One item: block `block` of (batch b, head h), its tokens [begin, begin + valid), valid <= 64.
// Items are numbered bh * blocks + block, which is also the index of the block's state.
struct TileItem {
  int b, h, begin, valid;
  size_t state;
};

__device__ __forceinline__ TileItem tile_item(const BlockLinearShape& s, int item) {
  const int bh = item / s.blocks, block = item % s.blocks, length = s.tokens / s.blocks;
  return {bh / s.heads, bh % s.heads, block * length, length, static_cast<size_t>(item)};
}

// All 64 rows of a tile into `tile` (row stride ld elements): rows past `valid` are zero-filled,
// since the products run over whole 16-row strips and garbage there could be NaN. The CTA's
// threads share the copies; the caller commits and waits.
template <int D>
__device__ __forceinline__ void copy_rows_async(const TokenTensor& x, const TileItem& item,
                                                Element* tile, int ld) {
  constexpr int kWordsPerRow = D / 8;
  for (int c = static_cast<int>(threadIdx.x); c < tiles::kTile * kWordsPerRow;
       c += fragment_rows::kFragmentThreads) {
    const int r = c / kWordsPerRow, word = c % kWordsPerRow;
    const bool live = r < item.valid;
    const Element* src =
        tiles::token_row<Element, D>(x, item.b, item.begin + (live ? r : 0), item.h) + word * 8;
    async_copy::copy_streaming16(tile + r * ld + word * 8, src, live);
  }
}

// A state of a packed set (D x D bf16, then D fp32): the matrix rows into s (row stride D + 8),
// z into its own array.
template <int D>
__device__ __forceinline__ void copy_packed_state_async(const float* set, size_t index, Element* s,
                                                        float* z) {
  constexpr int kWordsPerRow = D / 8, kZWords = D / 4;
  const float* state = set + index * (D * D / 2 + D);
  const Element* matrix = reinterpret_cast<const Element*>(state);
  for (int c = static_cast<int>(threadIdx.x); c < D * kWordsPerRow;
       c += fragment_rows::kFragmentThreads) {
    async_copy::copy_streaming16(s + (c / kWordsPerRow) * (D + 8) + (c % kWordsPerRow) * 8,
                                 matrix + c * 8, true);
  }
  if (threadIdx.x < kZWords)
    async_copy::copy_streaming16(z + threadIdx.x * 4, state + D * D / 2 + threadIdx.x * 4, true);
}

// Walks this CTA's items (blockIdx.x, then every gridDim.x-th) over two stages of shared memory:
// issue(item, stage) starts the copies of an item's inputs into a stage, body(item, stage) runs
// the item once they have landed. The item's one barrier also tells every warp that the previous
// item is done, so the next item's copies may refill its stage.
template <typename Issue, typename Body>
__device__ __forceinline__ void walk_items(const BlockLinearShape& shape, Issue&& issue,
                                           Body&& body) {
  const int items = shape.batch * shape.heads * shape.blocks;
  const int first = static_cast<int>(blockIdx.x), step = static_cast<int>(gridDim.x);
  if (first < items) issue(tile_item(shape, first), 0);
  async_copy::commit();
  int stage = 0;
  for (int item = first; item < items; item += step, stage ^= 1) {
    async_copy::wait<0>();
    __syncthreads();  // this item's inputs are in, from every thread's copies
    if (item + step < items) issue(tile_item(shape, item + step), stage ^ 1);
    async_copy::commit();
    body(tile_item(shape, item), stage);
  }
}

}  // namespace fragment_pipeline
}  // namespace mhla_kernels
