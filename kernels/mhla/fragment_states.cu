// The states pass of the bidirectional block-linear forward on mma.sync fragments (see
// block_fragment_passes.h and fragment_rows.cuh): S_j = phi(K)^T V and z_j = sum phi(k) over one
// chunk of block j. One CTA of four warps per (batch*head, block, chunk). Per 64-token tile:
//   1. row form: k and v (loaded one tile ahead, in registers); 1/rms(k); phi(k) and v to
//      shared tiles, v's with a column of ones (zero past the valid rows) for z;
//   2. after the tile's one barrier: each warp adds phi(K)^T [V, 1] into its slice of the state,
//      held in registers until the chunk ends.
// The tiles are double-buffered, so a warp can start the next tile while others finish step 2.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common/wmma_gemm.cuh"
#include "mhla/block_fragment_passes.h"
#include "mhla/block_work.cuh"
#include "mhla/fragment_launch.cuh"
#include "mhla/fragment_pipeline.cuh"
#include "mhla/fragment_rows.cuh"
#include "mhla/tiles.cuh"

namespace mhla_kernels {
namespace {

using namespace tiles;
using namespace fragment_rows;

// Buffers: 2 double-buffers the tiles (a CTA of several tiles); 1 holds one (a CTA of one tile).
template <int D, int Buffers>
constexpr size_t states_smem() {
  return Buffers * align128(kTile * (D + 8) * 2) +
         Buffers * align128(kTile * StateSlices<D>::ld_extra * 2);
}

template <typename T, int D, int MinBlocks, int Buffers>
__global__ void __launch_bounds__(kFragmentThreads, MinBlocks)
    fragment_states_kernel(BlockLinearForward p, int chunks) {
  using E = T;
  using R = RowHalves<D>;
  using S = StateSlices<D>;
  constexpr int ld = D + 8;
  constexpr int kPhiStride = static_cast<int>(align128(kTile * ld * 2) / 2);
  constexpr int kValueStride = static_cast<int>(align128(kTile * S::ld_extra * 2) / 2);
  extern __shared__ __align__(128) unsigned char smem[];
  E* phi_tiles = reinterpret_cast<E*>(smem);
  E* value_tiles = phi_tiles + Buffers * kPhiStride;

  const Work w = work_of(p.shape, chunks);
  const int row = lane_row(), seg = lane_half();
  uint4 raw_k[R::words], raw_v[R::words];
  auto issue = [&](int n0) {
    const bool live = row < w.end - n0;
    load_half<T, D>(p.k, w.b, n0 + row, w.h, live, raw_k);
    load_half<T, D>(p.v, w.b, n0 + row, w.h, live, raw_v);
  };
  if (w.begin < w.end) issue(w.begin);

  TileAccumulator state[1][S::col_tiles], z;
#pragma unroll
  for (int j = 0; j < S::col_tiles; ++j) state[0][j].zero();
  z.zero();
  int buffer = 0;
  for (int n0 = w.begin; n0 < w.end; n0 += kTile, buffer = (buffer + 1) % Buffers) {
    const int valid = min(kTile, w.end - n0), rows = (valid + 15) / 16 * 16;
    E* phi = phi_tiles + buffer * kPhiStride;
    E* values = value_tiles + buffer * kValueStride;
    {  // 1. Row form.
      const bool live = row < valid;
      const float scale = row_scale<E, D>(raw_k);
#pragma unroll
      for (int u = 0; u < R::words; ++u) {
        const int d0 = seg * R::half + u * 8;
        float unused[8];
        *reinterpret_cast<uint4*>(phi + row * ld + d0) =
            feature_word<E>(raw_k[u], scale, live, unused);
        *reinterpret_cast<uint4*>(values + row * S::ld_extra + d0) = raw_v[u];
      }
      store_extra_column<E, D>(values, row, live ? 1.f : 0.f);
    }
    if (n0 + kTile < w.end) issue(n0 + kTile);            // in flight through step 2
    __syncthreads();                                      // phi and v of all rows are in
    accumulate_state<E, D>(state, z, phi, values, rows);  // 2.
  }
  const size_t index = static_cast<size_t>(w.bh) * p.shape.blocks + w.block;
  if (p.packed_states) {  // one chunk per block (the host checks)
    write_packed_state<D>(state, z, p.states + index * PackedState<D>::floats);
  } else {
    write_state<D>(
        state, z, state_target(p.states, p.chunk_parts, p.shape, w, D * D + D),
        p.chunk_parts != nullptr ? StateWrite::store : state_write(chunks, p.scalar_state_adds));
  }
}

template <typename T, int D>
struct StatesPass {
  static constexpr void (*kernel)(BlockLinearForward, int) = fragment_states_kernel<T, D, 4, 2>;
  static constexpr size_t smem = states_smem<D, 2>();
};
template <typename T, int D>
struct StatesPassOneTile {  // one tile buffer; more CTAs per SM for CTAs of one tile
  static constexpr void (*kernel)(BlockLinearForward, int) = fragment_states_kernel<T, D, 5, 1>;
  static constexpr size_t smem = states_smem<D, 1>();
};

// The pipelined one-tile variant (fragment_pipeline.cuh): per stage k and v (at the extra-column
// row stride, the column of ones written after the copy). phi(k) replaces k in its own tile, so
// two stages fit five CTAs per SM. The state is written packed after every item.
template <int D>
struct StatesStage {
  static constexpr size_t keys = align128(kTile * (D + 8) * 2);
  static constexpr size_t bytes = keys + align128(kTile * StateSlices<D>::ld_extra * 2);
  static constexpr size_t smem = 2 * bytes;
};

// kChunks: the chunk walk (blocks longer than one tile), the state summed over the chunk's tiles
// in registers and written when its last tile is done: packed where one CTA owns each state,
// else fp32 (atomic adds, or the chunk's part of the ordered sums).
template <int D, bool kChunks, int MinBlocks>
__global__ void __launch_bounds__(kFragmentThreads, MinBlocks)
    pipelined_states_kernel(BlockLinearForward p, int chunks) {
  using E = fragment_pipeline::Element;
  using R = RowHalves<D>;
  using S = StateSlices<D>;
  using Stage = StatesStage<D>;
  constexpr int ld = D + 8;
  extern __shared__ __align__(128) unsigned char smem[];
  auto keys_of = [&](int s) { return reinterpret_cast<E*>(smem + s * Stage::bytes); };
  auto values_of = [&](int s) {
    return reinterpret_cast<E*>(smem + s * Stage::bytes + Stage::keys);
  };

  auto issue = [&](const fragment_pipeline::TileItem& it, int s) {
    fragment_pipeline::copy_rows_async<D, true>(p.k, it, keys_of(s), ld);
    fragment_pipeline::copy_rows_async<D, true>(p.v, it, values_of(s), S::ld_extra);
  };
  const int row = lane_row();
  TileAccumulator state[1][S::col_tiles], z;
  fragment_pipeline::walk<kChunks>(
      p.shape, chunks, issue, [&](const fragment_pipeline::TileItem& it, int stage) {
        E* phi = keys_of(stage);  // k, then phi(k)
        E* values = values_of(stage);
        {  // 1. Row form: phi(k) in place, the column of ones.
          const bool live = row < it.valid;
          uint4 raw_k[R::words];
          read_half<E, D>(phi + row * ld, raw_k);
          const float scale = row_scale<E, D>(raw_k);
          features_row<E, D>(raw_k, scale, live, phi + row * ld);
          store_extra_column<E, D>(values, row, live ? 1.f : 0.f);
        }
        __syncthreads();  // phi and v of all rows are in
        // 2. S += phi(K)^T [V, 1] over the tile; out after the chunk's last tile.
        if (!kChunks || it.opens) {
#pragma unroll
          for (int j = 0; j < S::col_tiles; ++j) state[0][j].zero();
          z.zero();
        }
        accumulate_state<E, D>(state, z, phi, values, (it.valid + 15) / 16 * 16);
        if (kChunks && !it.closes) return;
        if (kChunks && !p.packed_states) {
          write_state<D>(state, z,
                         fragment_pipeline::chunk_state_target(p.states, p.chunk_parts, p.shape, it,
                                                               D * D + D),
                         p.chunk_parts != nullptr ? StateWrite::store
                                                  : state_write(chunks, p.scalar_state_adds));
          return;
        }
        float* out = p.states + it.state * PackedState<D>::floats;
        if (p.direct_packed_stores) {
          write_packed_state<D>(state, z, out);
        } else {
          __syncthreads();  // every warp's reads of phi are done: each stages its slice there
          write_packed_state<D>(state, z, out, phi + (threadIdx.x / 32) * 16 * ld, ld);
        }
      });
}

// Five CTAs per SM for one-tile blocks: 60.9 us at N = 1,024, four (no spill) 61.8. The chunk
// form holds the state across tiles and runs four: five took 38.0 against 35.8 us at N = 4,096
// (session 43, call 3). At D = 64 it spilled 76 bytes at its 128 registers until its copies took
// copy_rows_async's full-tile branch (session 44: no spill, 36.8 -> 33.1 us at N = 4,096).
template <int D, bool ByChunks>
struct PipelinedStatesPass {
  static constexpr bool kChunks = ByChunks;
  static constexpr void (*kernel)(BlockLinearForward, int) = pipelined_states_kernel < D, ByChunks,
                                                      ByChunks ? 4 : 5 > ;
  static constexpr size_t smem = StatesStage<D>::smem;
};

}  // namespace

cudaError_t fragment_states(const BlockLinearForward& a, int chunks, cudaStream_t stream) {
  if (fragment_pipelined_variants(a.shape, a.dtype, chunks) && a.packed_states)
    return launch_pipelined_form<PipelinedStatesPass>(a, chunks, false, stream);
  if (fragment_chunk_pipelined(a.shape, a.dtype))
    return launch_pipelined_form<PipelinedStatesPass>(a, chunks, true, stream);
  return launch_pass<StatesPass, StatesPassOneTile>(a, chunks, stream);
}

}  // namespace mhla_kernels
