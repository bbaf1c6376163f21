#pragma once
// Bidirectional MHLA's state mix over packed state sets (block_linear_attention.h: per state D x D
// bf16, then D fp32), both directions in one kernel template:
//   forward:  S'_i = sum_j m_ij S_j                                (block_state_mix, packed_in)
//   backward: dS_j = sum_i m_ij dS'_i, dm_ij += sum dS'_i . S_j    (block_mix_backward, packed)
// Persistent CTAs of eight warps walk items of (batch*head, 512 columns of the matrix part, or 64
// of the fp32 rest). An item's rows of the input (and, backward, of S) for all blocks (zero-padded
// to 16) are copied into a stage of shared memory with cp.async while the item before it is
// computed. Matrix items run on tensor cores: each warp owns 64 columns, A = m (backward: m^T) as
// a bf16 high and low part (so the weights keep fp32 precision: up to 2^-16 |m_ij| per term is
// left out), B = the stage rows; the result goes out through the warp's own stage columns in
// 16-byte stores. Rest items run on CUDA cores in fp32. The backward's dm (tensor cores over the
// matrix part, fp32 over the rest) is summed per CTA and added once.
//
// The backward (session 27): dm += dS' S^T is exact bf16 products with fp32 sums, and the rest
// items in the same loop saved a second kernel (11.9 of 71 us, session 27 call 3); its fp32 form
// on CUDA cores (mix_backward_kernel on packed rows) was bound by its instruction count (90
// against 80 us on fp32 states at B = 64, N = 1,024, H = 6, D = 64, M = 16).
// Why the forward moved here (session 29): its CUDA-core kernel (block_state_mix.cu,
// packed_state_mix_kernel, 16 fp32 multiply-adds per output element) issued 22 million
// instructions at B = 64, N = 1,024, H = 6, D = 64, M = 16 and ran at 63 % of the copy bandwidth
// (39 us), where this form of the backward moves half again as many bytes in 42 us. Here the
// forward takes 27.4 us (89 %; call 5).
#include <cuda_bf16.h>

#include <cstdint>

#include "common/async_copy.cuh"
#include "common/dependent_launch.cuh"
#include "common/wmma_gemm.cuh"

namespace mhla_kernels {
namespace packed_mix {

struct PackedMix {
  const float* in = nullptr;        // packed set [batch_heads, blocks, row]: S, or dS' (backward)
  const float* states = nullptr;    // backward: S (for dm), a packed set the same way
  const float* mixing = nullptr;    // m [blocks, blocks] row-major, on the device
  float* out = nullptr;             // packed set: S', or dS (backward)
  float* grad_mixing = nullptr;     // backward: dm, the products ADDED
  int batch_heads = 0, blocks = 0;  // blocks <= kRows
  int64_t elements = 0;             // per state (matrix + rest), the rest a multiple of 4
  int64_t matrix = 0;               // bf16 elements per state: a multiple of kColumns
};

constexpr int kRows = 16;
constexpr int kWeightLd = kRows + 8;
// Items of the fp32 rest (z): 64 columns, fp32 rows of kRestLd floats in the stage.
constexpr int kRestColumns = 64, kRestLd = kRestColumns + 4;

// m as the tensor cores' A operand, a bf16 high and low part, and in fp32 for the rest items.
struct __align__(16) MixWeights {
  __nv_bfloat16 hi[kRows][kWeightLd], lo[kRows][kWeightLd];
  float fp32[kRows][kRows];
};

__device__ __forceinline__ float dot4(const float4& a, const float4& b, float acc) {
  return fmaf(a.w, b.w, fmaf(a.z, b.z, fmaf(a.y, b.y, fmaf(a.x, b.x, acc))));
}

// The items of one direction for CTAs of Warps warps: (batch*head, 64 * Warps columns of the
// matrix part, or 64 of the fp32 rest), numbered batch_head * columns + column item. A stage of
// shared memory holds one item's rows of the input (and, backward, of S) for all blocks, rows
// past `blocks` zero.
template <bool Backward, int Warps>
struct MixItems {
  static constexpr int kThreads = 32 * Warps, kColumns = 64 * Warps;
  static constexpr int kLd = kColumns + 8;  // bf16 per stage row: rows 16 bytes apart modulo 128
  static constexpr int kTensors = Backward ? 2 : 1;
  static constexpr int kStageElements = kTensors * kRows * kLd;  // bf16
  static constexpr size_t kStageBytes = static_cast<size_t>(kStageElements) * 2;
  static constexpr int kRestRows = kRows * kRestColumns / kThreads;  // output rows per thread
  static constexpr int kDmPairs = kRows * kRows / kThreads;          // dm pairs per thread
  static_assert(kTensors * kRows * kRestLd * 4 <= kStageBytes, "a rest item fits a stage");
  static_assert(kRows * kRows % kThreads == 0 && kRows * kRestColumns % kThreads == 0,
                "whole rest rows and dm pairs per thread");

  // Backward: this thread's dm products, its warp's tile over the matrix items and its pairs
  // (t + kThreads u) / 16, % 16 over the rest items.
  struct Dm {
    wmma_tiles::TileAccumulator tile;
    float rest[kDmPairs];
  };

  const PackedMix& p;
  int64_t row_floats, matrix_items, columns;

  __device__ explicit MixItems(const PackedMix& args) : p(args) {
    row_floats = p.matrix / 2 + p.elements - p.matrix;
    matrix_items = p.matrix / kColumns;
    columns = matrix_items + (p.elements - p.matrix + kRestColumns - 1) / kRestColumns;
  }
  __device__ int64_t items() const { return static_cast<int64_t>(p.batch_heads) * columns; }
  __device__ const float* set_of(int tensor) const { return tensor == 0 ? p.in : p.states; }

  // Thread t copies the item's 16-byte pieces t, t + kThreads, ... into `stage` (not committed).
  __device__ void issue(int64_t item, __nv_bfloat16* stage) const {
    const int t = threadIdx.x;
    const int64_t bh = item / columns;
    if (item % columns >= matrix_items) {  // rest: fp32 pieces of 4 floats
      const int64_t e0 = p.matrix + (item % columns - matrix_items) * kRestColumns;
      constexpr int kPiecesPerRow = kRestColumns / 4, kPieces = kTensors * kRows * kPiecesPerRow;
      float* rest_rows = reinterpret_cast<float*>(stage);
#pragma unroll
      for (int u = 0; u < kPieces / kThreads; ++u) {
        const int piece = t + kThreads * u;
        const int row = piece / kPiecesPerRow, column = piece % kPiecesPerRow;  // [tensors][kRows]
        const int r = row % kRows;
        const int64_t e = e0 + 4 * column;
        const bool in = r < p.blocks && e < p.elements;
        const float* src = set_of(row / kRows) +
                           (static_cast<size_t>(bh) * p.blocks + (in ? r : 0)) * row_floats +
                           p.matrix / 2 + (in ? e - p.matrix : 0);
        async_copy::copy_streaming16(rest_rows + row * kRestLd + 4 * column, src, in);
      }
    } else {
      const int64_t e0 = (item % columns) * kColumns;
      constexpr int kPiecesPerRow = kColumns / 8, kPieces = kTensors * kRows * kPiecesPerRow;
#pragma unroll
      for (int u = 0; u < kPieces / kThreads; ++u) {
        const int piece = t + kThreads * u;
        const int row = piece / kPiecesPerRow, column = piece % kPiecesPerRow;  // [tensors][kRows]
        const int r = row % kRows;
        const bool in = r < p.blocks;
        const __nv_bfloat16* src =
            reinterpret_cast<const __nv_bfloat16*>(
                set_of(row / kRows) +
                (static_cast<size_t>(bh) * p.blocks + (in ? r : 0)) * row_floats) +
            e0 + 8 * column;
        async_copy::copy_streaming16(stage + row * kLd + 8 * column, src, in);
      }
    }
  }

  // The item in `stage` (landed, after a barrier): its output rows r < blocks, and the
  // backward's dm products into dm. The warp writes its staged output over its own stage columns.
  template <bool Staged>
  __device__ void run(int64_t item, __nv_bfloat16* stage, const MixWeights& w, Dm& dm) const {
    using wmma_tiles::TileAccumulator;
    const int t = threadIdx.x, warp = t / 32;
    if (item % columns >= matrix_items) {
      const int64_t bh = item / columns;
      // Rest: thread t forms output rows kRestRows (t / 64) on at column t % 64 in fp32 (forward
      // out_i = sum_j m_ij x_j, backward out_j = sum_i m_ij x_i) and, backward, its dm pairs
      // over the item's columns.
      const float* rest_rows = reinterpret_cast<const float*>(stage);
      const int64_t e0 = p.matrix + (item % columns - matrix_items) * kRestColumns;
      const int c = t % kRestColumns, r0 = kRestRows * (t / kRestColumns);
      float out[kRestRows] = {};
#pragma unroll
      for (int k = 0; k < kRows; ++k) {
        const float x = rest_rows[k * kRestLd + c];
#pragma unroll
        for (int a = 0; a < kRestRows; ++a)
          out[a] = fmaf(Backward ? w.fp32[k][r0 + a] : w.fp32[r0 + a][k], x, out[a]);
      }
      if (e0 + c < p.elements) {
#pragma unroll
        for (int a = 0; a < kRestRows; ++a) {
          if (r0 + a < p.blocks) {
            p.out[(static_cast<size_t>(bh) * p.blocks + r0 + a) * row_floats + p.matrix / 2 +
                  (e0 + c - p.matrix)] = out[a];
          }
        }
      }
      if constexpr (Backward) {
#pragma unroll
        for (int u = 0; u < kDmPairs; ++u) {
          const int pair = t + kThreads * u;
          const float4* grad_row =
              reinterpret_cast<const float4*>(rest_rows + (pair / kRows) * kRestLd);
          const float4* state_row =
              reinterpret_cast<const float4*>(rest_rows + (kRows + pair % kRows) * kRestLd);
#pragma unroll
          for (int k = 0; k < kRestColumns / 4; ++k)
            dm.rest[u] = dot4(grad_row[k], state_row[k], dm.rest[u]);
        }
      }
      return;
    }
    const __nv_bfloat16* in_rows = stage + 64 * warp;
    if constexpr (Backward) {
      // dm += dS' S^T over this warp's 64 columns: A = dS' [i][e], B = S^T (S stored [j][e]).
      // First, so its fragments are dead before the output tiles live (after them it spilled 32
      // bytes at 128 registers, against 20).
      wmma_tiles::mma_tile<__nv_bfloat16, false, true>(dm.tile, in_rows, kLd, in_rows + kRows * kLd,
                                                       kLd, 0, 0, 64);
    }
    // out = m x (backward m^T x) over this warp's 64 columns: A = m, stored [i][j] (transposed
    // for the backward), B = the input rows [k][e].
    TileAccumulator out[1][4];
#pragma unroll
    for (int c = 0; c < 4; ++c) out[0][c].zero();
    wmma_tiles::mma_block<__nv_bfloat16, Backward, false, 1, 4>(out, &w.hi[0][0], kWeightLd,
                                                                in_rows, kLd, 0, 0, kRows);
    wmma_tiles::mma_block<__nv_bfloat16, Backward, false, 1, 4>(out, &w.lo[0][0], kWeightLd,
                                                                in_rows, kLd, 0, 0, kRows);
    // Output rows r < blocks into the packed set, as bf16.
    const int64_t bh = item / columns, e0 = (item % columns) * kColumns + 64 * warp;
    auto out_row = [&](int r) {
      return reinterpret_cast<__nv_bfloat16*>(p.out + (static_cast<size_t>(bh) * p.blocks + r) *
                                                          row_floats) +
             e0;
    };
    if constexpr (Staged) {
      // Through this warp's own input columns of the stage (only this warp reads them, and it
      // is done with them): each lane then stores whole 16-byte pieces, eight lanes a 128-byte
      // row segment, instead of 4-byte pairs that fill half of every 32-byte sector they touch.
      __nv_bfloat16* staged = stage + 64 * warp;
      __syncwarp();
#pragma unroll
      for (int i = 0; i < 4; i += 2) {
#pragma unroll
        for (int c = 0; c < 4; ++c) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            *reinterpret_cast<__nv_bfloat162*>(staged + TileAccumulator::row(i) * kLd + 16 * c +
                                               TileAccumulator::col(h, i)) =
                __floats2bfloat162_rn(out[0][c].x[h][i], out[0][c].x[h][i + 1]);
          }
        }
      }
      __syncwarp();
      const int lane = t % 32;
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int piece = lane + 32 * u, r = piece / 8, column = piece % 8;
        if (r < p.blocks) {
          *reinterpret_cast<uint4*>(out_row(r) + 8 * column) =
              *reinterpret_cast<const uint4*>(staged + r * kLd + 8 * column);
        }
      }
    } else {
#pragma unroll
      for (int i = 0; i < 4; i += 2) {
        const int r = TileAccumulator::row(i);
        if (r >= p.blocks) continue;
#pragma unroll
        for (int c = 0; c < 4; ++c) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            *reinterpret_cast<__nv_bfloat162*>(out_row(r) + 16 * c + TileAccumulator::col(h, i)) =
                __floats2bfloat162_rn(out[0][c].x[h][i], out[0][c].x[h][i + 1]);
          }
        }
      }
    }
  }

  // Backward: the CTA's dm, summed over its warps in `sums` (Warps x 256 floats of shared
  // memory, free), added into grad_mixing once. Contains a barrier.
  __device__ void add_dm(const Dm& dm, float* sums) const {
    using wmma_tiles::TileAccumulator;
    const int t = threadIdx.x, warp = t / 32;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        sums[warp * kRows * kRows + TileAccumulator::row(i) * kRows + TileAccumulator::col(h, i)] =
            dm.tile.x[h][i];
      }
    }
    __syncthreads();
#pragma unroll
    for (int u = 0; u < kDmPairs; ++u) {
      const int e = t + kThreads * u;
      float sum = dm.rest[u];
#pragma unroll
      for (int v = 0; v < Warps; ++v) sum += sums[v * kRows * kRows + e];
      const int i = e / kRows, j = e % kRows;
      if (i < p.blocks && j < p.blocks) atomicAdd(p.grad_mixing + i * p.blocks + j, sum);
    }
  }
};

// m = hi + lo, zero outside the matrix, by the CTA's Threads threads (a barrier must follow).
template <int Threads>
__device__ __forceinline__ void load_weights(const PackedMix& p, MixWeights& w) {
  for (int e = threadIdx.x; e < kRows * kRows; e += Threads) {
    const int i = e / kRows, j = e % kRows;
    const float m = i < p.blocks && j < p.blocks ? p.mixing[i * p.blocks + j] : 0.f;
    w.fp32[i][j] = m;
    const __nv_bfloat16 hi = __float2bfloat16_rn(m);
    w.hi[i][j] = hi;
    w.lo[i][j] = __float2bfloat16_rn(m - __bfloat162float(hi));
  }
}

constexpr int kThreads = 256, kWarps = kThreads / 32;
constexpr int kColumns = MixItems<false, kWarps>::kColumns;
constexpr int kStages = 2;
template <bool Backward>
constexpr size_t kSharedBytes = kStages * MixItems<Backward, kWarps>::kStageBytes;

// Persistent CTAs of eight warps walk all items, the next item's copies in flight during the
// current one.
template <bool Backward, bool Staged>
__global__ void __launch_bounds__(kThreads, 2) packed_mix_kernel(PackedMix p) {
  using Items = MixItems<Backward, kWarps>;
  extern __shared__ __align__(16) __nv_bfloat16 stage_rows[];  // [kStages][tensors][kRows][kLd]
  __shared__ MixWeights weights;
  __shared__ float dm_sums[Backward ? kWarps * kRows * kRows : 1];
  dependent_launch::wait_for_previous_grid();  // launched as a dependent grid: before any access
  dependent_launch::allow_next_grid();
  load_weights<kThreads>(p, weights);
  const Items walk(p);
  const int64_t items = walk.items();
  auto issue = [&](int64_t item, int stage) {
    if (item < items) walk.issue(item, stage_rows + stage * Items::kStageElements);
    async_copy::commit();  // empty past the end: the group count holds
  };
  typename Items::Dm dm;
  dm.tile.zero();
#pragma unroll
  for (int u = 0; u < Items::kDmPairs; ++u) dm.rest[u] = 0.f;
  issue(blockIdx.x, 0);
  int stage = 0;
  for (int64_t item = blockIdx.x; item < items; item += gridDim.x) {
    issue(item + gridDim.x, stage ^ 1);  // that stage was last read before the trailing barrier
    async_copy::wait<1>();
    __syncthreads();  // this item's rows (every thread's copies) and the weights are in
    walk.template run<Staged>(item, stage_rows + stage * Items::kStageElements, weights, dm);
    __syncthreads();  // done with this stage before the next iteration refills it
    stage ^= 1;
  }
  async_copy::wait<0>();
  if constexpr (Backward) walk.add_dm(dm, dm_sums);
}

// Every item of batch*head `bh` by this CTA of Warps warps over two stages of shared memory
// (stage0, stage1: MixItems::kStageBytes each), between barriers: the tails of the pipelined
// states and query passes, run by the CTA that finished the last block of `bh`
// (fragment_pipeline.cuh). The caller's own copies may still be in flight; the waits here
// include them, which costs nothing they would not. `dm_sums` (backward: Warps x 256 floats) may
// share stage0's bytes.
template <bool Backward, int Warps>
__device__ void mix_batch_head(const PackedMix& p, int64_t bh, __nv_bfloat16* stage0,
                               __nv_bfloat16* stage1, MixWeights& weights, float* dm_sums) {
  using Items = MixItems<Backward, Warps>;
  const Items walk(p);
  load_weights<Items::kThreads>(p, weights);
  typename Items::Dm dm;
  dm.tile.zero();
#pragma unroll
  for (int u = 0; u < Items::kDmPairs; ++u) dm.rest[u] = 0.f;
  const int64_t first = bh * walk.columns, end = first + walk.columns;
  walk.issue(first, stage0);
  async_copy::commit();
  for (int64_t item = first; item < end; ++item) {
    const bool odd = (item - first) & 1;
    if (item + 1 < end) walk.issue(item + 1, odd ? stage0 : stage1);
    async_copy::commit();
    async_copy::wait<1>();
    __syncthreads();  // this item's rows and the weights are in
    walk.template run<true>(item, odd ? stage1 : stage0, weights, dm);
    __syncthreads();  // done with this stage before the next item refills it
  }
  async_copy::wait<0>();
  if constexpr (Backward) walk.add_dm(dm, dm_sums);
}

// Whether the kernel takes these sizes: up to 16 blocks, a matrix part of a multiple of 512
// elements, a rest of a multiple of 4.
inline bool takes(int blocks, int64_t matrix, int64_t elements) {
  return blocks >= 1 && blocks <= kRows && matrix > 0 && matrix % kColumns == 0 &&
         elements >= matrix && (elements - matrix) % 4 == 0;
}

// Persistent CTAs: as many as fit on the GPU, at most one per item, launched as a dependent grid
// (common/dependent_launch.cuh).
template <bool Backward, bool Staged = true>
cudaError_t launch(const PackedMix& p, int multiprocessors, cudaStream_t stream) {
  const int64_t rest = (p.elements - p.matrix + kRestColumns - 1) / kRestColumns;
  const int64_t items = static_cast<int64_t>(p.batch_heads) * (p.matrix / kColumns + rest);
  if (items <= 0) return cudaSuccess;
  constexpr auto kernel = packed_mix_kernel<Backward, Staged>;
  constexpr size_t bytes = kSharedBytes<Backward>;
  static const int per_sm = [] {
    int count = 0;
    if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             static_cast<int>(bytes)) != cudaSuccess ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&count, kernel, kThreads, bytes) !=
            cudaSuccess)
      return 0;
    return count;
  }();
  if (per_sm < 1) return cudaErrorInvalidConfiguration;
  const int64_t resident = static_cast<int64_t>(per_sm) * multiprocessors;
  return dependent_launch::launch(kernel,
                                  dim3(static_cast<unsigned>(items < resident ? items : resident)),
                                  dim3(kThreads), bytes, stream, p);
}

}  // namespace packed_mix
}  // namespace mhla_kernels
