// The output pass of the bidirectional block-linear forward on mma.sync fragments (see
// block_fragment_passes.h and fragment_rows.cuh). One CTA of four warps per (batch*head, block,
// chunk), S'_i and z'_i in shared memory; each warp owns 16 rows of every 64-token tile and
// works alone after the state's load, without barriers:
//   1. row form: q (loaded one tile ahead, in registers); 1/rms(q), phi(q) to the warp's rows
//      of a shared tile, 1 / (phi(q) . z' + eps) per row;
//   2. phi(Q) S' on mma.sync, each row times its 1 / den, out through the same tile.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdlib>
#include <string>

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
constexpr int kLd = D + 8;

// Step 2 of a tile for the warp's rows (some valid): phi(Q) S' on mma.sync, each row times its
// 1 / den, out through the warp's rows of the phi tile.
template <typename E, int D>
__device__ __forceinline__ void output_rows_out(E* phi, const E* mixed, const float* inv_den,
                                                const BlockLinearForward& p, int b, int h, int n0,
                                                int valid) {
  constexpr int ld = kLd<D>;
  TileAccumulator numerator[1][D / 16];
#pragma unroll
  for (int j = 0; j < D / 16; ++j) numerator[0][j].zero();
  wmma_tiles::mma_block<E, false, false, 1, D / 16>(numerator, phi, ld, mixed, ld,
                                                    static_cast<int>(threadIdx.x / 32), 0, D);
  const float factor[2] = {inv_den[accumulator_row(0)], inv_den[accumulator_row(1)]};
  __syncwarp();  // the warp's reads of phi are done: the output rows go there
  store_rows<E, D>(numerator, factor, phi, ld);
  __syncwarp();
  copy_rows_out<E, D>(phi, ld, static_cast<E*>(p.out), p.shape.tokens, p.shape.heads, b, h, n0,
                      valid);
}

template <int D>
constexpr size_t output_smem() {
  return align128(D * kLd<D> * 2) + align128(kTile * kLd<D> * 2) + align128(D * 4) +
         align128(kTile * 4);
}

template <typename T, int D, int MinBlocks>
__global__ void __launch_bounds__(kFragmentThreads, MinBlocks)
    fragment_output_kernel(BlockLinearForward p, int chunks) {
  using E = T;
  using R = RowHalves<D>;
  constexpr int ld = kLd<D>;
  extern __shared__ __align__(128) unsigned char smem[];
  Carver carve{smem};
  E* mixed = carve.take<E>(D * ld * 2);    // S' [d][c]
  E* phi = carve.take<E>(kTile * ld * 2);  // then the output rows
  float* z = carve.take<float>(D * 4);
  float* inv_den = carve.take<float>(kTile * 4);

  const Work w = work_of(p.shape, chunks);
  const int warp = threadIdx.x / 32;
  const int row = lane_row(), seg = lane_half();
  uint4 raw_q[R::words];
  auto issue = [&](int n0) { load_half<T, D>(p.q, w.b, n0 + row, w.h, row < w.end - n0, raw_q); };
  if (w.begin < w.end) issue(w.begin);
  load_any_state<T, D>(p.mixed, static_cast<size_t>(w.bh) * p.shape.blocks + w.block,
                       p.packed_mixed, mixed, z);
  __syncthreads();  // the only barrier: from here on each warp touches only its own rows

  for (int n0 = w.begin; n0 < w.end; n0 += kTile) {
    const int valid = min(kTile, w.end - n0);
    {  // 1. Row form.
      const bool live = row < valid;
      const float scale = row_scale<E, D>(raw_q);
      const float den = pair_sum(features_dot<E, D>(raw_q, scale, live, z, phi + row * ld));
      if (seg == 0) inv_den[row] = 1.f / (den + kDenominatorEps);
    }
    if (n0 + kTile < w.end) issue(n0 + kTile);  // in flight through step 2
    __syncwarp();
    if (warp * 16 < valid)  // 2. The product, normalized, out.
      output_rows_out<E, D>(phi, mixed, inv_den, p, w.b, w.h, n0, valid);
    __syncwarp();  // the copies' reads are done before the next tile's rows are written
  }
}

template <typename T, int D>
struct OutputPass {
  static constexpr void (*kernel)(BlockLinearForward, int) = fragment_output_kernel<T, D, 4>;
  static constexpr size_t smem = output_smem<D>();
};
template <typename T, int D>
struct OutputPassOneTile {  // more CTAs per SM for CTAs of one tile
  static constexpr void (*kernel)(BlockLinearForward, int) = fragment_output_kernel<T, D, 6>;
  static constexpr size_t smem = output_smem<D>();
};

// The pipelined one-tile variant (fragment_pipeline.cuh): per stage q and S' with z'. phi(q)
// replaces q in its own tile (the raw rows are not needed after the row form), and the output
// rows replace phi(q), so two stages fit six CTAs per SM.
template <int D>
struct OutputStage {
  static constexpr size_t tile = align128(kTile * kLd<D> * 2), state = align128(D * kLd<D> * 2);
  static constexpr size_t bytes = tile + state + align128(D * 4);
  static constexpr size_t smem = 2 * bytes + align128(kTile * 4);
};

// kChunks: the chunk walk (blocks longer than one tile); a stage is refilled with S' only for a
// tile of another block than the stage's last.
template <int D, bool kChunks>
__global__ void __launch_bounds__(kFragmentThreads, 6)
    pipelined_output_kernel(BlockLinearForward p, int chunks) {
  using E = fragment_pipeline::Element;
  using R = RowHalves<D>;
  using Stage = OutputStage<D>;
  constexpr int ld = kLd<D>;
  extern __shared__ __align__(128) unsigned char smem[];
  auto rows_of = [&](int s) { return reinterpret_cast<E*>(smem + s * Stage::bytes); };
  auto mixed_of = [&](int s) {
    return reinterpret_cast<E*>(smem + s * Stage::bytes + Stage::tile);
  };
  auto z_of = [&](int s) {
    return reinterpret_cast<float*>(smem + s * Stage::bytes + Stage::tile + Stage::state);
  };
  float* inv_den = reinterpret_cast<float*>(smem + 2 * Stage::bytes);

  fragment_pipeline::StageStates held;
  auto issue = [&](const fragment_pipeline::TileItem& it, int s) {
    fragment_pipeline::copy_rows_async<D>(p.q, it, rows_of(s), ld);
    if (!kChunks || held.needs(s, it.state))
      fragment_pipeline::copy_packed_state_async<D>(p.mixed, it.state, mixed_of(s), z_of(s));
  };
  const int warp = threadIdx.x / 32;
  const int row = lane_row(), seg = lane_half();
  fragment_pipeline::walk<kChunks>(
      p.shape, chunks, issue, [&](const fragment_pipeline::TileItem& it, int stage) {
        E* rows = rows_of(stage);  // q, then phi(q), then the output rows
        const E* mixed = mixed_of(stage);
        {  // 1. Row form: phi(q) in place, 1 / den.
          const bool live = row < it.valid;
          uint4 raw_q[R::words];
          read_half<E, D>(rows + row * ld, raw_q);
          const float scale = row_scale<E, D>(raw_q);
          const float den =
              pair_sum(features_dot<E, D>(raw_q, scale, live, z_of(stage), rows + row * ld));
          if (seg == 0) inv_den[row] = 1.f / (den + kDenominatorEps);
        }
        __syncwarp();
        if (warp * 16 < it.valid)  // 2. The product, normalized, out.
          output_rows_out<E, D>(rows, mixed, inv_den, p, it.b, it.h, it.begin, it.valid);
      });
}

template <int D, bool ByChunks>
struct PipelinedOutputPass {
  static constexpr bool kChunks = ByChunks;
  static constexpr void (*kernel)(BlockLinearForward, int) = pipelined_output_kernel<D, ByChunks>;
  static constexpr size_t smem = OutputStage<D>::smem;
};

}  // namespace

bool fragment_passes_supported(DType dtype, int head_dim) {
  return (dtype == DType::bf16 || dtype == DType::f16) && (head_dim == 32 || head_dim == 64);
}

bool fragment_one_tile_variants(const BlockLinearShape& shape) {
  static const bool enabled = [] {
    const char* value = std::getenv("MHLA_FRAGMENT_ONE_TILE");
    return value == nullptr || std::string(value) != "0";
  }();
  return enabled && shape.blocks >= 1 && shape.tokens / shape.blocks <= tiles::kTile;
}

cudaError_t fragment_output(const BlockLinearForward& a, int chunks, cudaStream_t stream) {
  if (fragment_pipelined_variants(a.shape, a.dtype, chunks) && a.packed_mixed)
    return launch_pipelined_form<PipelinedOutputPass>(a, chunks, false, stream);
  if (fragment_chunk_pipelined(a.shape, a.dtype) && a.packed_mixed)
    return launch_pipelined_form<PipelinedOutputPass>(a, chunks, true, stream);
  return launch_pass<OutputPass, OutputPassOneTile>(a, chunks, stream);
}

}  // namespace mhla_kernels
