// The query pass of the bidirectional block-linear backward on mma.sync fragments (see
// block_fragment_passes.h and fragment_rows.cuh). One CTA of four warps per (batch*head, block,
// chunk); each warp owns 16 rows of every 64-token tile. Per tile:
//   1. row form: q and dO (loaded one tile ahead, in registers); 1/rms(q) and
//      den = phi(q) . z' + eps; phi(q), dnum = dO / den and the raw q rows to shared memory;
//   2. own rows: d(phi) = dnum S'^T; dO . o = phi(q) . d(phi) (o = phi(q) S' / den, so the
//      forward's output is not read); dden = -(dO . o) / den as column D of dnum; the feature
//      backward in accumulator form, dq out;
//   3. after the tile's one barrier: dS' += phi(Q)^T [dnum, dden] over all 64 rows, each warp a
//      16-row slice of dS' in registers until the chunk ends.
// phi and dnum tiles are double-buffered, so a warp can start the next tile while others finish
// step 3.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common/wmma_gemm.cuh"
#include "mhla/block_fragment_passes.h"
#include "mhla/block_work.cuh"
#include "mhla/fragment_launch.cuh"
#include "mhla/fragment_pipeline.cuh"
#include "mhla/fragment_rows.cuh"
#include "mhla/state_tiles.cuh"
#include "mhla/tiles.cuh"

namespace mhla_kernels {
namespace {

using namespace tiles;
using namespace fragment_rows;

template <int D>
struct QueryLayout {
  static constexpr int ld = D + 8;                      // S', phi(Q) and raw q rows
  static constexpr int ldn = StateSlices<D>::ld_extra;  // dnum, dden in column D
  static constexpr int state = D * D + D;
};

// Step 2 of a tile for the warp's rows (some valid): d(phi) = dnum S'^T; dO . o = phi(q) . d(phi)
// (o = phi(q) S' / den, so the forward's output is not read); dden = -(dO . o) / den into column D
// of dnum (for step 3's dz') and into the feature backward; dq out through the warp's rows of q.
template <typename E, int D, int Ldn = QueryLayout<D>::ldn>
__device__ __forceinline__ void query_rows_out(E* dnum, const E* mixed, const E* phi, E* q_raw,
                                               const float* inv_den_rows, const float* scale_rows,
                                               const float* z, const BlockLinearBackward& p, int b,
                                               int h, int n0, int valid) {
  using Q = QueryLayout<D>;
  const int warp = threadIdx.x / 32;
  TileAccumulator dphi[1][D / 16];
#pragma unroll
  for (int j = 0; j < D / 16; ++j) dphi[0][j].zero();
  wmma_tiles::mma_block<E, false, true, 1, D / 16>(dphi, dnum, Ldn, mixed, Q::ld, warp, 0, D);
  const int r0 = accumulator_row(0), r1 = accumulator_row(1);
  const float g_dot_o[2] = {row_dot<E, D>(dphi, phi, Q::ld, 0), row_dot<E, D>(dphi, phi, Q::ld, 1)};
  const float dden[2] = {-g_dot_o[0] * inv_den_rows[r0], -g_dot_o[1] * inv_den_rows[r1]};
  store_extra_columns<E, D, Ldn>(dnum, dden);
  const float scale[2] = {scale_rows[r0], scale_rows[r1]};
  feature_backward<E, D>(dphi, q_raw, q_raw, Q::ld, scale, dden, z);
  __syncwarp();
  copy_rows_out<E, D>(q_raw, Q::ld, static_cast<E*>(p.grad_q), p.shape.tokens, p.shape.heads, b, h,
                      n0, valid);
}

// The floats the mix backward adds into, zeroed by one CTA (BlockLinearBackward::zero_on_entry).
__device__ __forceinline__ void zero_on_entry(const BlockLinearBackward& p) {
  for (int i = threadIdx.x; i < p.zero_floats; i += blockDim.x) p.zero_on_entry[i] = 0.f;
}

template <int D>
constexpr size_t query_smem() {
  using Q = QueryLayout<D>;
  return align128(D * Q::ld * 2) + 2 * align128(kTile * Q::ld * 2) +
         2 * align128(kTile * Q::ldn * 2) + align128(kTile * Q::ld * 2) + align128(D * 4) +
         2 * align128(kTile * 4);
}

template <typename T, int D>
__global__ void __launch_bounds__(kFragmentThreads, 3)
    fragment_query_backward_kernel(BlockLinearBackward p, int chunks) {
  using Q = QueryLayout<D>;
  using E = T;
  extern __shared__ __align__(128) unsigned char smem[];
  Carver carve{smem};
  E* mixed = carve.take<E>(D * Q::ld * 2);  // S' [d][c]
  E* phi_tiles = carve.take<E>(2 * align128(kTile * Q::ld * 2));
  E* dnum_tiles = carve.take<E>(2 * align128(kTile * Q::ldn * 2));
  E* q_raw = carve.take<E>(kTile * Q::ld * 2);  // then dq, per warp's rows
  float* z = carve.take<float>(D * 4);
  float* inv_den_rows = carve.take<float>(kTile * 4);
  float* scale_rows = carve.take<float>(kTile * 4);
  constexpr int kPhiStride = static_cast<int>(align128(kTile * Q::ld * 2) / 2);
  constexpr int kDnumStride = static_cast<int>(align128(kTile * Q::ldn * 2) / 2);

  const Work w = work_of(p.shape, chunks);
  const size_t state_index = static_cast<size_t>(w.bh) * p.shape.blocks + w.block;
  const int warp = threadIdx.x / 32;
  if (blockIdx.x == 0 && blockIdx.y == 0) zero_on_entry(p);

  using R = RowHalves<D>;
  const int row = lane_row(), seg = lane_half();
  uint4 raw_q[R::words], raw_g[R::words];
  auto issue = [&](int n0) {
    const bool live = row < w.end - n0;
    load_half<T, D>(p.q, w.b, n0 + row, w.h, live, raw_q);
    load_half<T, D>(p.grad_out, w.b, n0 + row, w.h, live, raw_g);
  };
  if (w.begin < w.end) issue(w.begin);
  load_any_state<T, D>(p.mixed, state_index, p.packed_mixed, mixed, z);
  __syncthreads();

  TileAccumulator dstate[1][StateSlices<D>::col_tiles], dz;
#pragma unroll
  for (int j = 0; j < StateSlices<D>::col_tiles; ++j) dstate[0][j].zero();
  dz.zero();
  int buffer = 0;
  for (int n0 = w.begin; n0 < w.end; n0 += kTile, buffer ^= 1) {
    const int valid = min(kTile, w.end - n0), rows = (valid + 15) / 16 * 16;
    E* phi = phi_tiles + buffer * kPhiStride;
    E* dnum = dnum_tiles + buffer * kDnumStride;
    // 1. Row form.
    {
      const bool live = row < valid;
      const float scale = row_scale<E, D>(raw_q);
      float den = features_dot<E, D>(raw_q, scale, live, z, phi + row * Q::ld);
#pragma unroll
      for (int u = 0; u < R::words; ++u) {
        *reinterpret_cast<uint4*>(q_raw + row * Q::ld + seg * R::half + u * 8) = raw_q[u];
      }
      den = pair_sum(den);  // every lane: a shuffle under `live ?` deadlocks partial tiles
      const float inv = live ? 1.f / (den + kDenominatorEps) : 0.f;
#pragma unroll
      for (int u = 0; u < R::words; ++u) {
        *reinterpret_cast<uint4*>(dnum + row * Q::ldn + seg * R::half + u * 8) =
            scaled_word<E>(raw_g[u], inv);
      }
      if (seg == 0) {
        inv_den_rows[row] = inv;
        scale_rows[row] = scale;
      }
    }
    if (n0 + kTile < w.end) issue(n0 + kTile);  // in flight through steps 2 and 3
    __syncwarp();
    // 2. d(phi) of the warp's rows, the feature backward, dq.
    if (warp * 16 < valid)
      query_rows_out<E, D>(dnum, mixed, phi, q_raw, inv_den_rows, scale_rows, z, p, w.b, w.h, n0,
                           valid);
    __syncthreads();  // phi and dnum of all rows are in
    // 3. dS' += phi(Q)^T dnum and dz' += phi(Q)^T dden over the tile.
    accumulate_state<E, D>(dstate, dz, phi, dnum, rows);
  }
  if (p.packed_grad_mixed) {  // one chunk per block (the host checks)
    // Staged in the warp's own rows of q_raw: every warp copied its dq rows out before the
    // last tile's barrier, and no one reads q_raw after it.
    write_packed_state<D>(dstate, dz, p.grad_mixed + state_index * PackedState<D>::floats,
                          p.direct_packed_stores
                              ? nullptr
                              : reinterpret_cast<__nv_bfloat16*>(q_raw + warp * 16 * Q::ld),
                          Q::ld);
  } else {
    write_state<D>(
        dstate, dz, state_target(p.grad_mixed, p.chunk_parts, p.shape, w, Q::state),
        p.chunk_parts != nullptr ? StateWrite::store : state_write(chunks, p.scalar_state_adds));
  }
}

template <typename T, int D>
struct QueryPass {
  static constexpr void (*kernel)(BlockLinearBackward, int) = fragment_query_backward_kernel<T, D>;
  static constexpr size_t smem = query_smem<D>();
};

// The pipelined one-tile variants (fragment_pipeline.cuh): per stage q and dO (at dnum's row
// stride: dnum = dO / den is formed in place); phi(Q) and the row factors outside the stages.
// dS' is written packed after every item. Two layouts:
//  - three CTAs per SM: S' and z' in both stages, dnum with room for 16 extra columns;
//  - four CTAs per SM (default; MHLA_QUERY_PASS_CTAS=3 for the other): one S' buffer, refilled
//    for the next item once every warp is past step 2, and dnum at the rows' stride with dden in
//    its column D only (the dz' product reads columns D .. D + 15, the last 8 from the next row:
//    only its column 0 is kept). 55 KB instead of 68 KB: the pass was waiting on the chain of its
//    steps with 12 warps per SM (73 % of the copy bandwidth at N = 1,024; the other passes
//    reach 85-90 %). Session 30: 81.7-82.0 -> 77.1-78.1 us per launch at that shape.
template <int D>
struct QueryStage {
  using Q = QueryLayout<D>;
  static constexpr int kMinBlocks = 3, ldn = Q::ldn;
  static constexpr bool kOneState = false;
  static constexpr size_t rows = align128(kTile * Q::ld * 2), dnum = align128(kTile * ldn * 2),
                          state = align128(D * Q::ld * 2);
  static constexpr size_t bytes = rows + dnum + state + align128(D * 4);
  static constexpr size_t states_at = rows + dnum;  // in each stage
  static constexpr size_t shared_at = 2 * bytes;    // phi, then the row factors
  static constexpr size_t smem = shared_at + rows + 2 * align128(kTile * 4);
};
template <int D>
struct QueryStageOneState {
  using Q = QueryLayout<D>;
  static constexpr int kMinBlocks = 4, ldn = D + 8;
  static constexpr bool kOneState = true;
  // dnum's last row's dz' product reads 16 bytes past it: they stay inside (racecheck saw that
  // read meet the next buffer's copies).
  static constexpr size_t rows = align128(kTile * Q::ld * 2), dnum = align128(kTile * ldn * 2 + 16),
                          state = align128(D * Q::ld * 2);
  static constexpr size_t bytes = rows + dnum;
  static constexpr size_t states_at = 2 * bytes;  // S', z': one buffer after the stages
  static constexpr size_t shared_at = states_at + state + align128(D * 4);
  static constexpr size_t smem = shared_at + rows + 2 * align128(kTile * 4);
  static_assert(4 * (smem + 1024) <= 228 * 1024, "four CTAs per SM");
};

// kChunks: the chunk walk (blocks longer than one tile), dS' summed over the chunk's tiles in
// registers and written after its last tile: packed where one CTA owns each state, else fp32
// (atomic adds, or the chunk's part of the ordered sums). A tile of the same block as the last
// one in its S' buffer (one buffer, or its stage's) keeps the S' that is there.
template <int D, class Stage, bool kChunks>
__global__ void __launch_bounds__(kFragmentThreads, Stage::kMinBlocks)
    pipelined_query_backward_kernel(BlockLinearBackward p, int chunks) {
  using E = fragment_pipeline::Element;
  using Q = QueryLayout<D>;
  using R = RowHalves<D>;
  extern __shared__ __align__(128) unsigned char smem[];
  auto q_of = [&](int s) { return reinterpret_cast<E*>(smem + s * Stage::bytes); };
  auto dnum_of = [&](int s) { return reinterpret_cast<E*>(smem + s * Stage::bytes + Stage::rows); };
  auto mixed_of = [&](int s) {
    return reinterpret_cast<E*>(smem + (Stage::kOneState ? 0 : s * Stage::bytes) +
                                Stage::states_at);
  };
  auto z_of = [&](int s) {
    return reinterpret_cast<float*>(smem + (Stage::kOneState ? 0 : s * Stage::bytes) +
                                    Stage::states_at + Stage::state);
  };
  E* phi = reinterpret_cast<E*>(smem + Stage::shared_at);
  float* inv_den_rows = reinterpret_cast<float*>(smem + Stage::shared_at + Stage::rows);
  float* scale_rows = inv_den_rows + align128(kTile * 4) / 4;

  auto issue_state = [&](const fragment_pipeline::TileItem& it, int s) {
    fragment_pipeline::copy_packed_state_async<D>(p.mixed, it.state, mixed_of(s), z_of(s));
  };
  fragment_pipeline::StageStates held_in_stage;
  auto issue = [&](const fragment_pipeline::TileItem& it, int s) {
    fragment_pipeline::copy_rows_async<D, true>(p.q, it, q_of(s), Q::ld);
    fragment_pipeline::copy_rows_async<D, true>(p.grad_out, it, dnum_of(s), Stage::ldn);
    if constexpr (!Stage::kOneState) {
      if (!kChunks || held_in_stage.needs(s, it.state)) issue_state(it, s);
    }
  };
  size_t held_state = ~size_t{0};  // the block whose S' the one buffer holds (or is receiving)
  auto issue_late = [&](const fragment_pipeline::TileItem& it) {
    if constexpr (Stage::kOneState) {
      if (!kChunks || it.state != held_state) issue_state(it, 0);
      held_state = it.state;
    }
  };
  const int warp = threadIdx.x / 32;
  const int row = lane_row(), seg = lane_half();
  TileAccumulator dstate[1][StateSlices<D>::col_tiles], dz;
  fragment_pipeline::walk<kChunks>(
      p.shape, chunks, issue, issue_late,
      [&](const fragment_pipeline::TileItem& it, int stage, auto&& late) {
        E* q_raw = q_of(stage);  // then dq, per warp's rows
        E* dnum = dnum_of(stage);
        const E* mixed = mixed_of(stage);
        const float* z = z_of(stage);
        // CTA 0's first item.
        if (it.state == 0 && it.opens && it.chunk == 0) zero_on_entry(p);
        {  // 1. Row form: phi(q), den, dnum = dO / den in place.
          const bool live = row < it.valid;
          uint4 raw_q[R::words];
          read_half<E, D>(q_raw + row * Q::ld, raw_q);
          const float scale = row_scale<E, D>(raw_q);
          float den = features_dot<E, D>(raw_q, scale, live, z, phi + row * Q::ld);
          den = pair_sum(den);  // every lane: a shuffle under `live ?` deadlocks partial tiles
          const float inv = live ? 1.f / (den + kDenominatorEps) : 0.f;
#pragma unroll
          for (int u = 0; u < R::words; ++u) {
            uint4* word = reinterpret_cast<uint4*>(dnum + row * Stage::ldn + seg * R::half + u * 8);
            *word = scaled_word<E>(*word, inv);
          }
          if (seg == 0) {
            inv_den_rows[row] = inv;
            scale_rows[row] = scale;
          }
        }
        __syncwarp();
        // 2. d(phi) of the warp's rows, the feature backward, dq.
        if (warp * 16 < it.valid)
          query_rows_out<E, D, Stage::ldn>(dnum, mixed, phi, q_raw, inv_den_rows, scale_rows, z, p,
                                           it.b, it.h, it.begin, it.valid);
        __syncthreads();  // phi and dnum of all rows are in; S' and z' are read
        late();           // one S' buffer: the next item's
        // 3. dS' += phi(Q)^T dnum and dz' += phi(Q)^T dden over the tile; out after the
        // chunk's last tile.
        if (!kChunks || it.opens) {
#pragma unroll
          for (int j = 0; j < StateSlices<D>::col_tiles; ++j) dstate[0][j].zero();
          dz.zero();
        }
        accumulate_state<E, D, Stage::ldn>(dstate, dz, phi, dnum, (it.valid + 15) / 16 * 16);
        if (kChunks && !it.closes) return;
        if (kChunks && !p.packed_grad_mixed) {
          write_state<D>(dstate, dz,
                         fragment_pipeline::chunk_state_target(p.grad_mixed, p.chunk_parts, p.shape,
                                                               it, Q::state),
                         p.chunk_parts != nullptr ? StateWrite::store
                                                  : state_write(chunks, p.scalar_state_adds));
          return;
        }
        // Staged in the warp's own rows of q (its dq rows went out before the barrier).
        write_packed_state<D>(dstate, dz, p.grad_mixed + it.state * PackedState<D>::floats,
                              p.direct_packed_stores ? nullptr : q_raw + warp * 16 * Q::ld, Q::ld);
      });
}

template <template <int> class Stage>
struct PipelinedQueryPassIn {
  template <int D, bool ByChunks>
  using Pass =
      PipelinedPass<Stage<D>, pipelined_query_backward_kernel<D, Stage<D>, ByChunks>, ByChunks>;
};

// The pipelined pass at four CTAs per SM unless MHLA_QUERY_PASS_CTAS=3.
bool query_pass_one_state() {
  static const bool on = one_state_unless_three_ctas("MHLA_QUERY_PASS_CTAS");
  return on;
}

}  // namespace

cudaError_t fragment_query_backward(const BlockLinearBackward& a, int chunks, cudaStream_t stream) {
  const bool one_tile = fragment_pipelined_variants(a.shape, a.dtype, chunks) && a.packed_mixed &&
                        a.packed_grad_mixed;
  if (one_tile || (fragment_chunk_pipelined(a.shape, a.dtype) && a.packed_mixed)) {
    if (query_pass_one_state()) {
      return launch_pipelined_form<PipelinedQueryPassIn<QueryStageOneState>::Pass>(
          a, chunks, !one_tile, stream);
    }
    return launch_pipelined_form<PipelinedQueryPassIn<QueryStage>::Pass>(a, chunks, !one_tile,
                                                                         stream);
  }
  return launch_pass<QueryPass>(a, chunks, stream);
}

}  // namespace mhla_kernels
