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
#include "common/dependent_launch.cuh"
#include "mhla/block_linear_attention.h"
#include "mhla/fragment_rows.cuh"
#include "mhla/tiles.cuh"

namespace mhla_kernels {
namespace fragment_pipeline {

using Element = __nv_bfloat16;  // packed states exist for bf16 inputs only

// One item: block `block` of (batch b, head h), its tokens [begin, begin + valid), valid <= 64.
// Items are numbered bh * blocks + block, which is also the index of the block's state.
// In the chunk walk (walk_chunk_tiles) an item is one tile of a chunk [begin of its first tile,
// end) of block `block`: `opens` marks its first tile, `closes` its last; one-tile items open and
// close their chunk 0.
struct TileItem {
  int b, h, block, begin, valid;
  size_t state;
  int chunk = 0, end = 0;
  bool opens = true, closes = true;
};

// A CTA's walk over the items: item, item + step, ... The first item takes divisions by the
// runtime sizes; each later one adds the step's block, head and batch parts with carries (the
// divisions had cost about 75 instructions per warp and item, 5 % of the query pass's).
class ItemWalk {
 public:
  __device__ ItemWalk(const BlockLinearShape& s, int step)
      : blocks_(s.blocks), heads_(s.heads), length_(s.tokens / s.blocks), step_(step) {
    const int step_bh = step / s.blocks;
    step_block_ = step % s.blocks, step_h_ = step_bh % s.heads, step_b_ = step_bh / s.heads;
  }
  __device__ TileItem at(int item) const {
    const int bh = item / blocks_, block = item % blocks_;
    return {bh / heads_, bh % heads_,
            block,       block * length_,
            length_,     static_cast<size_t>(item),
            0,           (block + 1) * length_};
  }
  __device__ TileItem next(TileItem it) const {
    it.block += step_block_;
    const int block_carry = it.block >= blocks_;
    it.block -= block_carry * blocks_;
    it.h += step_h_ + block_carry;  // < 2 heads
    const int head_carry = it.h >= heads_;
    it.h -= head_carry * heads_;
    it.b += step_b_ + head_carry;
    it.begin = it.block * length_;
    it.end = it.begin + length_;
    it.state += step_;
    return it;
  }

 private:
  int blocks_, heads_, length_, step_, step_block_, step_h_, step_b_;
};

// All 64 rows of a tile into `tile` (row stride ld elements): rows past `valid` are zero-filled,
// since the products run over whole 16-row strips and garbage there could be NaN. The CTA's
// threads share the copies; the caller commits and waits. Each thread copies one 16-byte column
// of every (threads / words per row)-th row, so its addresses are one 64-bit base and fixed
// steps: computing a row, a column and a [B, N, H, D] offset per copy made the copies and the
// item walk 25-32 % of the query and key passes' instructions (session 29, call 1).
// FullTiles: a branch for full tiles, whose copies then need no row test. Session 44 (Nsight at
// N = 4,096 and 16,384, one binary per form): it took the states pass's chunk form from 76 bytes
// of spills to none (36.8 -> 33.1 us) and the query pass 1-3 us faster, but made the output pass
// 2 us and the key pass 6-7 us slower, so those two leave it off.
template <int D, bool FullTiles = false>
__device__ __forceinline__ void copy_rows_async(const TokenTensor& x, const TileItem& item,
                                                Element* tile, int ld) {
  constexpr int kWordsPerRow = D / 8, kRowsPerPass = fragment_rows::kFragmentThreads / kWordsPerRow;
  static_assert(tiles::kTile % kRowsPerPass == 0, "whole passes over the tile");
  const int row = static_cast<int>(threadIdx.x) / kWordsPerRow;
  const int column = static_cast<int>(threadIdx.x) % kWordsPerRow * 8;
  const Element* first = tiles::token_row<Element, D>(x, item.b, item.begin, item.h) + column;
  const Element* src = first + row * x.token_stride;
  const int64_t step = kRowsPerPass * x.token_stride;
  Element* dst = tile + row * ld + column;
  if (FullTiles && item.valid == tiles::kTile) {  // warp-uniform: no per-copy row test
#pragma unroll
    for (int pass = 0; pass < tiles::kTile / kRowsPerPass; ++pass)
      async_copy::copy_streaming16(dst + pass * kRowsPerPass * ld, src + pass * step, true);
    return;
  }
#pragma unroll
  for (int pass = 0; pass < tiles::kTile / kRowsPerPass; ++pass) {
    const bool live = row + pass * kRowsPerPass < item.valid;
    async_copy::copy_streaming16(dst + pass * kRowsPerPass * ld, live ? src + pass * step : first,
                                 live);
  }
}

// A state of a packed set (D x D bf16, then D fp32): the matrix rows into s (row stride D + 8),
// z into its own array.
template <int D>
__device__ __forceinline__ void copy_packed_state_async(const float* set, size_t index, Element* s,
                                                        float* z) {
  constexpr int kWordsPerRow = D / 8, kZWords = D / 4;
  constexpr int kRowsPerPass = fragment_rows::kFragmentThreads / kWordsPerRow;
  const float* state = set + index * fragment_rows::PackedState<D>::floats;
  const int row = static_cast<int>(threadIdx.x) / kWordsPerRow;
  const int column = static_cast<int>(threadIdx.x) % kWordsPerRow * 8;
  const Element* src = reinterpret_cast<const Element*>(state) + row * D + column;
  Element* dst = s + row * (D + 8) + column;
#pragma unroll
  for (int pass = 0; pass < D / kRowsPerPass; ++pass) {
    async_copy::copy_streaming16(dst + pass * kRowsPerPass * (D + 8), src + pass * kRowsPerPass * D,
                                 true);
  }
  if (threadIdx.x < kZWords)
    async_copy::copy_streaming16(z + threadIdx.x * 4,
                                 state + fragment_rows::PackedState<D>::z + threadIdx.x * 4, true);
}

// Walks this CTA's items (blockIdx.x, then every gridDim.x-th) over two stages of shared memory:
// issue(item, stage) starts the copies of an item's inputs into a stage, body(item, stage, late)
// runs the item once they have landed. The item's one barrier also tells every warp that the
// previous item is done, so the next item's copies may refill its stage. Inputs with a single
// buffer: issue_late(item) copies them when the body calls late(), behind a barrier after its
// last read of them (all of an item's copies have landed by its barrier).
// The pipelined kernels are launched as dependent grids (common/dependent_launch.cuh): the walk
// begins by waiting for the previous grid, before any global access of issue or body.
template <typename Issue, typename IssueLate, typename Body>
__device__ __forceinline__ void walk_items(const BlockLinearShape& shape, Issue&& issue,
                                           IssueLate&& issue_late, Body&& body) {
  dependent_launch::wait_for_previous_grid();
  dependent_launch::allow_next_grid();
  const int items = shape.batch * shape.heads * shape.blocks;
  const int first = static_cast<int>(blockIdx.x), step = static_cast<int>(gridDim.x);
  if (first >= items) return;
  const ItemWalk walk(shape, step);
  TileItem current = walk.at(first);
  issue(current, 0);
  issue_late(current);
  async_copy::commit();
  int stage = 0;
  for (int item = first; item < items; item += step, stage ^= 1) {
    async_copy::wait<0>();
    __syncthreads();  // this item's inputs are in, from every thread's copies
    const TileItem next = walk.next(current);
    const bool more = item + step < items;
    if (more) issue(next, stage ^ 1);
    async_copy::commit();
    body(current, stage, [&] {
      if (more) issue_late(next);
      async_copy::commit();
    });
    current = next;
  }
}

// As above, every input in the two stages.
template <typename Issue, typename Body>
__device__ __forceinline__ void walk_items(const BlockLinearShape& shape, Issue&& issue,
                                           Body&& body) {
  walk_items(
      shape, issue, [](const TileItem&) {},
      [&](const TileItem& it, int stage, auto&&) { body(it, stage); });
}

// The chunk walk, for blocks longer than one tile (MHLA at N >= 4,096, linear attention): the
// items are the 64-token tiles of the passes' chunks (block_work.cuh: at most kChunk tokens of one
// block). A CTA takes chunks blockIdx.x, + gridDim.x, ... and walks each one's tiles in order, so
// the states and query passes sum a chunk in registers and write it once, as the one-shot CTAs
// do; the copies of the next tile (of this chunk or the next) overlap the current one's work.
// Why: the one-shot CTAs of those shapes load a tile ahead into registers, but a CTA covers only
// four tiles and starts and ends with nothing in flight; at N = 4,096 their passes moved their
// bytes at 2.3-3.2 TB/s against 3.3-3.8 for the pipelined one-tile passes at N = 1,024.
class ChunkWalk {
 public:
  __device__ ChunkWalk(const BlockLinearShape& s, int chunks)
      : chunks_(chunks),
        batch_heads_(s.batch * s.heads),
        blocks_(s.blocks),
        heads_(s.heads),
        length_(s.tokens / s.blocks) {}
  // With many chunks per state (kChunkMajorFrom or more) chunks are numbered chunk-major (chunk
  // c of every state, then c + 1), so the CTAs that run at the same time add into different
  // states; with fewer, state-major, so a block's chunks run on neighbouring CTAs. Session 43,
  // call 6, five rounds of each: linear attention at N = 16,384 (64 chunks a state) 0.226-0.228
  // ms chunk-major against 0.234-0.239; MHLA there (4) 0.249-0.257 against 0.245-0.246.
  static constexpr int kChunkMajorFrom = 16;
  __device__ TileItem first_tile(int64_t chunk_index) const {
    int state, chunk;
    if (chunks_ >= kChunkMajorFrom) {
      const int64_t states = static_cast<int64_t>(batch_heads_) * blocks_;
      state = static_cast<int>(chunk_index % states);
      chunk = static_cast<int>(chunk_index / states);
    } else {
      state = static_cast<int>(chunk_index / chunks_);
      chunk = static_cast<int>(chunk_index % chunks_);
    }
    const int bh = state / blocks_;
    TileItem it;
    it.b = bh / heads_;
    it.h = bh % heads_;
    it.block = state % blocks_;
    it.chunk = chunk;
    it.begin = it.block * length_ + it.chunk * tiles::kChunk;
    it.end = min(it.begin + tiles::kChunk, (it.block + 1) * length_);
    it.valid = min(tiles::kTile, it.end - it.begin);
    it.state = static_cast<size_t>(bh) * blocks_ + it.block;
    it.opens = true;
    it.closes = it.begin + tiles::kTile >= it.end;
    return it;
  }
  __device__ static TileItem next_tile(TileItem it) {
    it.begin += tiles::kTile;
    it.valid = min(tiles::kTile, it.end - it.begin);
    it.opens = false;
    it.closes = it.begin + tiles::kTile >= it.end;
    return it;
  }

 private:
  int chunks_, batch_heads_, blocks_, heads_, length_;
};

// walk_items for the chunk walk: the same stages, barrier and hooks, over this CTA's chunks'
// tiles.
template <typename Issue, typename IssueLate, typename Body>
__device__ __forceinline__ void walk_chunk_tiles(const BlockLinearShape& shape, int chunks,
                                                 Issue&& issue, IssueLate&& issue_late,
                                                 Body&& body) {
  dependent_launch::wait_for_previous_grid();
  dependent_launch::allow_next_grid();
  const int64_t total =
      static_cast<int64_t>(shape.batch) * shape.heads * shape.blocks * static_cast<int64_t>(chunks);
  int64_t chunk = blockIdx.x;
  if (chunk >= total) return;
  const ChunkWalk walk(shape, chunks);
  TileItem current = walk.first_tile(chunk);
  issue(current, 0);
  issue_late(current);
  async_copy::commit();
  for (int stage = 0;; stage ^= 1) {
    async_copy::wait<0>();
    __syncthreads();  // this tile's inputs are in, from every thread's copies
    bool more = true;
    TileItem next;
    if (!current.closes) {
      next = ChunkWalk::next_tile(current);
    } else {
      chunk += gridDim.x;
      more = chunk < total;
      if (more) next = walk.first_tile(chunk);
    }
    if (more) issue(next, stage ^ 1);
    async_copy::commit();
    body(current, stage, [&] {
      if (more) issue_late(next);
      async_copy::commit();
    });
    if (!more) break;
    current = next;
  }
}

// The walk of a pipelined pass: the chunk walk where kChunks, else the one-tile walk.
template <bool kChunks, typename Issue, typename IssueLate, typename Body>
__device__ __forceinline__ void walk(const BlockLinearShape& shape, int chunks, Issue&& issue,
                                     IssueLate&& issue_late, Body&& body) {
  if constexpr (kChunks) {
    walk_chunk_tiles(shape, chunks, issue, issue_late, body);
  } else {
    walk_items(shape, issue, issue_late, body);
  }
}
template <bool kChunks, typename Issue, typename Body>
__device__ __forceinline__ void walk(const BlockLinearShape& shape, int chunks, Issue&& issue,
                                     Body&& body) {
  walk<kChunks>(
      shape, chunks, issue, [](const TileItem&) {},
      [&](const TileItem& it, int stage, auto&&) { body(it, stage); });
}

// Which state each of the two stages holds (or is receiving). In the chunk walk consecutive tiles
// mostly share their block's state: a stage that holds it already is not refilled (its buffer is
// only read while the tiles use it).
class StageStates {
 public:
  __device__ bool needs(int stage, size_t state) {
    size_t& held = stage != 0 ? second_ : first_;
    if (held == state) return false;
    held = state;
    return true;
  }

 private:
  size_t first_ = ~size_t{0}, second_ = ~size_t{0};
};

// Where a chunk's state (floats per state `state_floats`) goes when the CTA that summed it writes
// it as fp32 (block_work.cuh's state_target for a chunk-walk item).
__device__ __forceinline__ float* chunk_state_target(float* set, float* chunk_parts,
                                                     const BlockLinearShape& s, const TileItem& it,
                                                     size_t state_floats) {
  if (chunk_parts == nullptr) return set + it.state * state_floats;
  const size_t states = static_cast<size_t>(s.batch) * s.heads * s.blocks;
  return chunk_parts + (static_cast<size_t>(it.chunk) * states + it.state) * state_floats;
}

}  // namespace fragment_pipeline
}  // namespace mhla_kernels
