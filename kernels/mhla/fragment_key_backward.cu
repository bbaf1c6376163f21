// The key pass of the bidirectional block-linear backward on mma.sync fragments (see
// block_fragment_passes.h and fragment_rows.cuh). One CTA of four warps per (batch*head, block,
// chunk), dS_j and dz_j in shared memory; each warp owns 16 rows of every 64-token tile and
// works alone after the state's load, without barriers:
//   1. row form: k and v (loaded one tile ahead, in registers); 1/rms(k); phi(k), raw k and v
//      rows to the warp's rows of three shared tiles;
//   2. dv = phi(K) dS and d(phi) = V dS^T on mma.sync; dv out; the feature backward with dz
//      added to every row; dk out.
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
constexpr int kLd = D + 8;  // elements per row of every tile (ldmatrix without bank conflicts)

// Step 2 of a tile for the warp's rows (some valid), in two parts around the chunk form's
// barrier (every read of dS and dz is in the first):
//   key_products: dv = phi(K) dS, out through the warp's rows of phi, then d(phi) = V dS^T + dz
//     (the normalizer's term, the same for every row), one product after the other so that only
//     one set of accumulators is live (the chunk form then fits four CTAs' 128 registers at
//     D = 64 without spills; with both products live the passes took 160-168);
//   key_rows_out: the feature backward, dk and dv out.
template <typename E, int D>
__device__ __forceinline__ void key_products(TileAccumulator (&dphi)[1][D / 16], E* phi,
                                             const E* v_raw, const E* dstate, const float* dz) {
  constexpr int ld = kLd<D>;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const float ones[2] = {1.f, 1.f};
  {
    TileAccumulator dv[1][D / 16];
#pragma unroll
    for (int j = 0; j < D / 16; ++j) dv[0][j].zero();
    wmma_tiles::mma_block<E, false, false, 1, D / 16>(dv, phi, ld, dstate, ld, warp, 0, D);
    __syncwarp();  // the warp's reads of phi are done: dv goes there
    store_rows<E, D>(dv, ones, phi, ld);
  }
#pragma unroll
  for (int j = 0; j < D / 16; ++j) dphi[0][j].zero();
  wmma_tiles::mma_block<E, false, true, 1, D / 16>(dphi, v_raw, ld, dstate, ld, warp, 0, D);
#pragma unroll
  for (int j = 0; j < D / 16; ++j) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float2 add = *reinterpret_cast<const float2*>(dz + j * 16 + h * 8 + (lane % 4) * 2);
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        dphi[0][j].x[h][2 * r] += add.x;
        dphi[0][j].x[h][2 * r + 1] += add.y;
      }
    }
  }
}

template <typename E, int D>
__device__ __forceinline__ void key_rows_out(TileAccumulator (&dphi)[1][D / 16], const E* phi,
                                             E* k_raw, const float* scale_rows,
                                             const BlockLinearBackward& p, int b, int h, int n0,
                                             int valid) {
  constexpr int ld = kLd<D>;
  const float unused[2] = {0.f, 0.f};
  const float scale[2] = {scale_rows[accumulator_row(0)], scale_rows[accumulator_row(1)]};
  feature_backward<E, D, false>(dphi, k_raw, k_raw, ld, scale, unused, nullptr);
  __syncwarp();
  copy_rows_out<E, D>(phi, ld, static_cast<E*>(p.grad_v), p.shape.tokens, p.shape.heads, b, h, n0,
                      valid);
  copy_rows_out<E, D>(k_raw, ld, static_cast<E*>(p.grad_k), p.shape.tokens, p.shape.heads, b, h, n0,
                      valid);
}

template <int D>
constexpr size_t key_smem() {
  return align128(D * kLd<D> * 2) + 3 * align128(kTile * kLd<D> * 2) + align128(D * 4) +
         align128(kTile * 4);
}

template <typename T, int D>
__global__ void __launch_bounds__(kFragmentThreads, 4)
    fragment_key_backward_kernel(BlockLinearBackward p, int chunks) {
  using E = T;
  using R = RowHalves<D>;
  constexpr int ld = kLd<D>;
  extern __shared__ __align__(128) unsigned char smem[];
  Carver carve{smem};
  E* dstate = carve.take<E>(D * ld * 2);     // dS [d][c]
  E* phi = carve.take<E>(kTile * ld * 2);    // then dv
  E* k_raw = carve.take<E>(kTile * ld * 2);  // then dk
  E* v_raw = carve.take<E>(kTile * ld * 2);
  float* dz = carve.take<float>(D * 4);
  float* scale_rows = carve.take<float>(kTile * 4);

  const Work w = work_of(p.shape, chunks);
  const int warp = threadIdx.x / 32;
  const int row = lane_row(), seg = lane_half();
  uint4 raw_k[R::words], raw_v[R::words];
  auto issue = [&](int n0) {
    const bool live = row < w.end - n0;
    load_half<T, D>(p.k, w.b, n0 + row, w.h, live, raw_k);
    load_half<T, D>(p.v, w.b, n0 + row, w.h, live, raw_v);
  };
  if (w.begin < w.end) issue(w.begin);
  load_any_state<T, D>(p.grad_states, static_cast<size_t>(w.bh) * p.shape.blocks + w.block,
                       p.packed_grad_states, dstate, dz);
  __syncthreads();  // the only barrier: from here on each warp touches only its own rows

  for (int n0 = w.begin; n0 < w.end; n0 += kTile) {
    const int valid = min(kTile, w.end - n0);
    {  // 1. Row form.
      const bool live = row < valid;
      const float scale = row_scale<E, D>(raw_k);
#pragma unroll
      for (int u = 0; u < R::words; ++u) {
        const int d0 = seg * R::half + u * 8;
        float unused[8];
        *reinterpret_cast<uint4*>(phi + row * ld + d0) =
            feature_word<E>(raw_k[u], scale, live, unused);
        *reinterpret_cast<uint4*>(k_raw + row * ld + d0) = raw_k[u];
        *reinterpret_cast<uint4*>(v_raw + row * ld + d0) = raw_v[u];
      }
      if (seg == 0) scale_rows[row] = scale;
    }
    if (n0 + kTile < w.end) issue(n0 + kTile);  // in flight through step 2
    __syncwarp();
    if (warp * 16 < valid) {  // 2. Products, dv, the feature backward, dk.
      TileAccumulator dphi[1][D / 16];
      key_products<E, D>(dphi, phi, v_raw, dstate, dz);
      key_rows_out<E, D>(dphi, phi, k_raw, scale_rows, p, w.b, w.h, n0, valid);
    }
    __syncwarp();  // the copies' reads are done before the next tile's rows are written
  }
}

template <typename T, int D>
struct KeyPass {
  static constexpr void (*kernel)(BlockLinearBackward, int) = fragment_key_backward_kernel<T, D>;
  static constexpr size_t smem = key_smem<D>();
};

// The pipelined variants (fragment_pipeline.cuh): per stage k and v; the feature tile and the
// row scales outside the stages. Two layouts of dS_j and dz_j:
//  - in each stage (KeyStage: 64 KB at D = 64, three CTAs per SM): the one-tile form, whose every
//    tile is a new block;
//  - one buffer after the stages (KeyStageOneState: 55 KB, four CTAs per SM, default for the
//    chunk form; MHLA_KEY_PASS_CTAS=3 for the other): refilled for the next chunk's block after
//    a barrier that follows the chunk's last products, so the copy overlaps that tile's feature
//    backward and stores. Four CTAs fit the registers since dv and d(phi) are taken one after
//    the other (key_products).
template <int D>
struct KeyStage {
  static constexpr int kMinBlocks = 3;
  static constexpr bool kOneState = false;
  static constexpr size_t tile = align128(kTile * kLd<D> * 2), state = align128(D * kLd<D> * 2);
  static constexpr size_t bytes = 2 * tile + state + align128(D * 4);
  static constexpr size_t shared_at = 2 * bytes;  // phi, then the row scales
  static constexpr size_t smem = shared_at + tile + align128(kTile * 4);
  __device__ static size_t state_at(int s) { return s * bytes + 2 * tile; }  // dz after it
};
template <int D>
struct KeyStageOneState {
  static constexpr int kMinBlocks = 4;
  static constexpr bool kOneState = true;
  static constexpr size_t tile = align128(kTile * kLd<D> * 2), state = align128(D * kLd<D> * 2);
  static constexpr size_t bytes = 2 * tile;
  static constexpr size_t shared_at = 2 * bytes + state + align128(D * 4);
  static constexpr size_t smem = shared_at + tile + align128(kTile * 4);
  static_assert(4 * (smem + 1024) <= 228 * 1024, "four CTAs per SM");
  __device__ static size_t state_at(int) { return 2 * bytes; }  // dS, dz: after the stages
};

// kChunks: the chunk walk (blocks longer than one tile); dS is refilled only for a tile of
// another block than the last one in its buffer.
template <int D, class Stage, bool kChunks>
__global__ void __launch_bounds__(kFragmentThreads, Stage::kMinBlocks)
    pipelined_key_backward_kernel(BlockLinearBackward p, int chunks) {
  using E = fragment_pipeline::Element;
  using R = RowHalves<D>;
  constexpr int ld = kLd<D>;
  extern __shared__ __align__(128) unsigned char smem[];
  auto k_of = [&](int s) { return reinterpret_cast<E*>(smem + s * Stage::bytes); };
  auto v_of = [&](int s) { return reinterpret_cast<E*>(smem + s * Stage::bytes + Stage::tile); };
  auto dstate_of = [&](int s) { return reinterpret_cast<E*>(smem + Stage::state_at(s)); };
  auto dz_of = [&](int s) {
    return reinterpret_cast<float*>(smem + Stage::state_at(s) + Stage::state);
  };
  E* phi = reinterpret_cast<E*>(smem + Stage::shared_at);  // then dv
  float* scale_rows = reinterpret_cast<float*>(smem + Stage::shared_at + Stage::tile);

  fragment_pipeline::StageStates held;
  auto issue = [&](const fragment_pipeline::TileItem& it, int s) {
    fragment_pipeline::copy_rows_async<D>(p.k, it, k_of(s), ld);
    fragment_pipeline::copy_rows_async<D>(p.v, it, v_of(s), ld);
    if constexpr (!Stage::kOneState) {
      if (!kChunks || held.needs(s, it.state))
        fragment_pipeline::copy_packed_state_async<D>(p.grad_states, it.state, dstate_of(s),
                                                      dz_of(s));
    }
  };
  int held_state = -1;  // the block whose dS the one buffer holds (or is receiving)
  auto issue_late = [&](const fragment_pipeline::TileItem& it) {
    if constexpr (Stage::kOneState) {
      if (static_cast<int>(it.state) != held_state)
        fragment_pipeline::copy_packed_state_async<D>(p.grad_states, it.state, dstate_of(0),
                                                      dz_of(0));
      held_state = static_cast<int>(it.state);
    }
  };
  const int warp = threadIdx.x / 32;
  const int row = lane_row(), seg = lane_half();
  fragment_pipeline::walk<kChunks>(
      p.shape, chunks, issue, issue_late,
      [&](const fragment_pipeline::TileItem& it, int stage, auto&& late) {
        E* k_raw = k_of(stage);  // then dk
        {  // 1. Row form: phi(k) and 1/rms(k) of the lane's half row.
          const bool live = row < it.valid;
          uint4 raw_k[R::words];
          read_half<E, D>(k_raw + row * ld, raw_k);
          const float scale = row_scale<E, D>(raw_k);
          features_row<E, D>(raw_k, scale, live, phi + row * ld);
          if (seg == 0) scale_rows[row] = scale;
        }
        __syncwarp();
        // 2. Products, dv, the feature backward, dk.
        const bool rows = warp * 16 < it.valid;
        TileAccumulator dphi[1][D / 16];
        if (rows) key_products<E, D>(dphi, phi, v_of(stage), dstate_of(stage), dz_of(stage));
        if (Stage::kOneState && it.closes) {  // no warp reads dS or dz past here
          __syncthreads();
          late();  // the next chunk's block's
        }
        if (rows) key_rows_out<E, D>(dphi, phi, k_raw, scale_rows, p, it.b, it.h, it.begin, it.valid);
      });
}

template <template <int> class Stage>
struct PipelinedKeyPassIn {
  template <int D, bool ByChunks>
  using Pass =
      PipelinedPass<Stage<D>, pipelined_key_backward_kernel<D, Stage<D>, ByChunks>, ByChunks>;
};

// The chunk form at four CTAs per SM unless MHLA_KEY_PASS_CTAS=3.
bool key_pass_one_state() {
  static const bool on = one_state_unless_three_ctas("MHLA_KEY_PASS_CTAS");
  return on;
}

}  // namespace

cudaError_t fragment_key_backward(const BlockLinearBackward& a, int chunks, cudaStream_t stream) {
  if (fragment_pipelined_variants(a.shape, a.dtype, chunks) && a.packed_grad_states)
    return launch_pipelined_form<PipelinedKeyPassIn<KeyStage>::Pass>(a, chunks, false, stream);
  if (fragment_chunk_pipelined(a.shape, a.dtype) && a.packed_grad_states) {
    if (key_pass_one_state())
      return launch_pipelined_form<PipelinedKeyPassIn<KeyStageOneState>::Pass>(a, chunks, true,
                                                                               stream);
    return launch_pipelined_form<PipelinedKeyPassIn<KeyStage>::Pass>(a, chunks, true, stream);
  }
  return launch_pass<KeyPass>(a, chunks, stream);
}

}  // namespace mhla_kernels
