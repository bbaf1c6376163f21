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

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <numeric>

#include "common/async_copy.cuh"
#include "common/dependent_launch.cuh"
#include "common/wmma_gemm.cuh"

namespace mhla_kernels {
namespace packed_mix {

struct PackedMix {
  const float* in = nullptr;      // packed set [batch_heads, blocks, row]: S, or dS' (backward)
  const float* states = nullptr;  // backward: S (for dm), a packed set the same way
  const float* mixing = nullptr;  // m [blocks, blocks] row-major, on the device
  float* out = nullptr;           // packed set: S', or dS (backward)
  float* grad_mixing = nullptr;   // backward: dm, the products ADDED
  float* grad_mixing_parts = nullptr;  // backward, deterministic: CTA c's dm into part c instead
  int batch_heads = 0, blocks = 0;     // blocks <= kRows
  int64_t elements = 0;                // per state (matrix + rest), the rest a multiple of 4
  int64_t matrix = 0;                  // bf16 elements per state: a multiple of kColumns
  bool reverse = false;                // walk the items last to first (see launch())
};

constexpr int kThreads = 256, kWarps = kThreads / 32;
constexpr int kRows = 16, kColumns = 512;
constexpr int kLd = kColumns + 8;  // bf16 per stage row: rows 16 bytes apart modulo 128
constexpr int kStages = 2;
constexpr int kWeightLd = kRows + 8;
// Items of the fp32 rest (z): 64 columns, fp32 rows of kRestLd floats in the stage.
constexpr int kRestColumns = 64, kRestLd = kRestColumns + 4;
static_assert(kColumns == 64 * kWarps, "each warp owns 64 columns of an item");
static_assert(kRows * kRows == kThreads, "one dm pair per thread in rest items");

// Input tensors per item (backward: dS' and S) and the stage sizes that follow.
template <bool Backward>
struct Stage {
  static constexpr int tensors = Backward ? 2 : 1;
  static constexpr int elements = tensors * kRows * kLd;  // bf16
  static constexpr size_t shared_bytes = static_cast<size_t>(kStages) * elements * 2;
  static_assert(tensors * kRows * kRestLd * 4 <= elements * 2, "a rest item fits a stage");
};

__device__ __forceinline__ float dot4(const float4& a, const float4& b, float acc) {
  return fmaf(a.w, b.w, fmaf(a.z, b.z, fmaf(a.y, b.y, fmaf(a.x, b.x, acc))));
}

// Staged: the result goes out through shared memory in 16-byte pieces (else 4-byte pairs from the
// accumulators; MHLA_MIX_BACKWARD_STORES=direct, for A/B runs of the backward): 42.9 against
// 61.3 us for the backward at B = 64, N = 1,024, H = 6, D = 64, M = 16 (session 27, call 7).
template <bool Backward, bool Staged>
__global__ void __launch_bounds__(kThreads, 2) packed_mix_kernel(PackedMix p) {
  using wmma_tiles::TileAccumulator;
  using St = Stage<Backward>;
  extern __shared__ __align__(16) __nv_bfloat16 stage_rows[];  // [kStages][tensors][kRows][kLd]
  __shared__ __align__(16) __nv_bfloat16 weights_hi[kRows][kWeightLd], weights_lo[kRows][kWeightLd];
  __shared__ float weights[kRows][kRows];  // fp32, for rest items
  __shared__ float dm_sums[Backward ? kWarps : 1][kRows * kRows];
  dependent_launch::wait_for_previous_grid();  // launched as a dependent grid: before any access
  dependent_launch::allow_next_grid();
  const int t = threadIdx.x, warp = t / 32;
  for (int e = t; e < kRows * kRows; e += kThreads) {  // m = hi + lo, zero outside the matrix
    const int i = e / kRows, j = e % kRows;
    const float m = i < p.blocks && j < p.blocks ? p.mixing[i * p.blocks + j] : 0.f;
    weights[i][j] = m;
    const __nv_bfloat16 hi = __float2bfloat16_rn(m);
    weights_hi[i][j] = hi;
    weights_lo[i][j] = __float2bfloat16_rn(m - __bfloat162float(hi));
  }
  const int64_t matrix = p.matrix;
  const int64_t row_floats = matrix / 2 + p.elements - matrix;
  // Items per batch*head: the matrix part's, then the rest's (fp32, on CUDA cores).
  const int64_t matrix_items = matrix / kColumns;
  const int64_t columns = matrix_items + (p.elements - matrix + kRestColumns - 1) / kRestColumns;
  const int64_t items = static_cast<int64_t>(p.batch_heads) * columns;
  auto set_of = [&](int tensor) { return tensor == 0 ? p.in : p.states; };
  // Thread t copies 16-byte pieces t, t + 256, ... of the item's rows (rows past `blocks` zero).
  auto issue = [&](int64_t item, int stage) {
    if (item < items && item % columns >= matrix_items) {  // rest: fp32 pieces of 4 floats
      const int64_t bh = item / columns;
      const int64_t e0 = matrix + (item % columns - matrix_items) * kRestColumns;
      constexpr int kPiecesPerRow = kRestColumns / 4, kPieces = St::tensors * kRows * kPiecesPerRow;
      float* rest_rows = reinterpret_cast<float*>(stage_rows + stage * St::elements);
#pragma unroll
      for (int u = 0; u < kPieces / kThreads; ++u) {
        const int piece = t + kThreads * u;
        const int row = piece / kPiecesPerRow, column = piece % kPiecesPerRow;  // [tensors][kRows]
        const int r = row % kRows;
        const int64_t e = e0 + 4 * column;
        const bool in = r < p.blocks && e < p.elements;
        const float* src = set_of(row / kRows) +
                           (static_cast<size_t>(bh) * p.blocks + (in ? r : 0)) * row_floats +
                           matrix / 2 + (in ? e - matrix : 0);
        async_copy::copy_streaming16(rest_rows + row * kRestLd + 4 * column, src, in);
      }
    } else if (item < items) {
      const int64_t bh = item / columns, e0 = (item % columns) * kColumns;
      constexpr int kPiecesPerRow = kColumns / 8, kPieces = St::tensors * kRows * kPiecesPerRow;
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
        async_copy::copy_streaming16(stage_rows + stage * St::elements + row * kLd + 8 * column,
                                     src, in);
      }
    }
    asm volatile("cp.async.commit_group;\n" ::);  // empty past the end: the group count holds
  };
  TileAccumulator dm;  // backward: this warp's k-slices of dm, over all its matrix items
  dm.zero();
  float dm_rest = 0.f;  // backward: pair (t / 16, t % 16) of dm over the rest items
  // The CTA's w-th item of the walk: w itself, or counted from the end; `items` (nothing) past it.
  auto item_at = [&](int64_t w) { return w >= items ? items : p.reverse ? items - 1 - w : w; };
  issue(item_at(blockIdx.x), 0);
  int stage = 0;
  for (int64_t w = blockIdx.x; w < items; w += gridDim.x) {
    const int64_t item = item_at(w);
    // The next item into the other stage, which was last read before the trailing barrier.
    issue(item_at(w + gridDim.x), stage ^ 1);
    asm volatile("cp.async.wait_group 1;\n" ::);
    __syncthreads();  // this item's rows (every thread's copies) and the weights are in
    if (item % columns >= matrix_items) {
      // Rest: thread t forms output rows 4 (t / 64) to + 3 at column t % 64 in fp32 (forward
      // out_i = sum_j m_ij x_j, backward out_j = sum_i m_ij x_i) and, backward, dm's pair
      // (t / 16, t % 16) over the item's columns.
      const float* rest_rows = reinterpret_cast<const float*>(stage_rows + stage * St::elements);
      const int64_t bh = item / columns;
      const int64_t e0 = matrix + (item % columns - matrix_items) * kRestColumns;
      const int c = t % kRestColumns, r0 = 4 * (t / kRestColumns);
      float out[4] = {};
#pragma unroll
      for (int k = 0; k < kRows; ++k) {
        const float x = rest_rows[k * kRestLd + c];
#pragma unroll
        for (int a = 0; a < 4; ++a)
          out[a] = fmaf(Backward ? weights[k][r0 + a] : weights[r0 + a][k], x, out[a]);
      }
      if (e0 + c < p.elements) {
#pragma unroll
        for (int a = 0; a < 4; ++a) {
          if (r0 + a < p.blocks) {
            p.out[(static_cast<size_t>(bh) * p.blocks + r0 + a) * row_floats + matrix / 2 +
                  (e0 + c - matrix)] = out[a];
          }
        }
      }
      if constexpr (Backward) {
        const float4* grad_row = reinterpret_cast<const float4*>(rest_rows + (t / kRows) * kRestLd);
        const float4* state_row =
            reinterpret_cast<const float4*>(rest_rows + (kRows + t % kRows) * kRestLd);
#pragma unroll
        for (int k = 0; k < kRestColumns / 4; ++k)
          dm_rest = dot4(grad_row[k], state_row[k], dm_rest);
      }
      __syncthreads();  // done with this stage before the next iteration refills it
      stage ^= 1;
      continue;
    }
    const __nv_bfloat16* in_rows = stage_rows + stage * St::elements + 64 * warp;
    if constexpr (Backward) {
      // dm += dS' S^T over this warp's 64 columns: A = dS' [i][e], B = S^T (S stored [j][e]).
      // First, so its fragments are dead before the output tiles live (after them it spilled 32
      // bytes at 128 registers, against 20).
      wmma_tiles::mma_tile<__nv_bfloat16, false, true>(dm, in_rows, kLd, in_rows + kRows * kLd, kLd,
                                                       0, 0, 64);
    }
    // out = m x (backward m^T x) over this warp's 64 columns: A = m, stored [i][j] (transposed
    // for the backward), B = the input rows [k][e].
    TileAccumulator out[1][4];
#pragma unroll
    for (int c = 0; c < 4; ++c) out[0][c].zero();
    wmma_tiles::mma_block<__nv_bfloat16, Backward, false, 1, 4>(out, &weights_hi[0][0], kWeightLd,
                                                                in_rows, kLd, 0, 0, kRows);
    wmma_tiles::mma_block<__nv_bfloat16, Backward, false, 1, 4>(out, &weights_lo[0][0], kWeightLd,
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
      __nv_bfloat16* staged = const_cast<__nv_bfloat16*>(in_rows);
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
    __syncthreads();  // done with this stage before the next iteration refills it
    stage ^= 1;
  }
  asm volatile("cp.async.wait_group 0;\n" ::);
  if constexpr (Backward) {
    // dm summed over the warps, then added to grad_mixing once per CTA.
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        dm_sums[warp][TileAccumulator::row(i) * kRows + TileAccumulator::col(h, i)] = dm.x[h][i];
      }
    }
    __syncthreads();
    for (int e = t; e < kRows * kRows; e += kThreads) {
      float sum = e == t ? dm_rest : 0.f;  // kThreads == kRows * kRows: e == t
#pragma unroll
      for (int w = 0; w < kWarps; ++w) sum += dm_sums[w][e];
      const int i = e / kRows, j = e % kRows;
      if (i >= p.blocks || j >= p.blocks) continue;
      if (p.grad_mixing_parts != nullptr) {
        p.grad_mixing_parts[(static_cast<size_t>(blockIdx.x) * p.blocks + i) * p.blocks + j] = sum;
      } else {
        atomicAdd(p.grad_mixing + i * p.blocks + j, sum);
      }
    }
  }
}

// Whether the kernel takes these sizes: up to 16 blocks, a matrix part of a multiple of 512
// elements, a rest of a multiple of 4.
inline bool takes(int blocks, int64_t matrix, int64_t elements) {
  return blocks >= 1 && blocks <= kRows && matrix > 0 && matrix % kColumns == 0 &&
         elements >= matrix && (elements - matrix) % 4 == 0;
}

// Persistent CTAs: as many as fit on the GPU (fewer where that shares a factor with the items
// per batch*head, below), at most one per item, launched as a dependent grid
// (common/dependent_launch.cuh).
// The persistent grid that launch() takes: as many CTAs as fit on the GPU (fewer where that
// shares a factor with the items per batch*head, below), at most one per item; 0 when there are
// no items, -1 when the kernel cannot run. Every CTA has an item.
template <bool Backward, bool Staged = true>
int64_t grid_for(const PackedMix& p, int multiprocessors) {
  const int64_t rest = (p.elements - p.matrix + kRestColumns - 1) / kRestColumns;
  const int64_t items = static_cast<int64_t>(p.batch_heads) * (p.matrix / kColumns + rest);
  if (items <= 0) return 0;
  constexpr auto kernel = packed_mix_kernel<Backward, Staged>;
  constexpr size_t bytes = Stage<Backward>::shared_bytes;
  static const int per_sm = [] {
    int count = 0;
    if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             static_cast<int>(bytes)) != cudaSuccess ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&count, kernel, kThreads, bytes) !=
            cudaSuccess)
      return 0;
    return count;
  }();
  if (per_sm < 1) return -1;
  // A CTA takes items c, c + grid, ... of the numbering batch*head-major, `columns` items per
  // batch*head, the last of them a rest item of a quarter of the bytes. With a grid sharing a
  // factor with `columns` (264 CTAs and 9 items at D = 64) a CTA meets only some column items:
  // a third of the CTAs got a rest item every third item, the others none, and those set the
  // kernel's end. A grid coprime with `columns` gives every CTA every column item in turn.
  const int64_t columns = p.matrix / kColumns + rest;
  int64_t grid = std::min(items, static_cast<int64_t>(per_sm) * multiprocessors);
  static const bool coprime = [] {  // MHLA_MIX_GRID=resident: every resident CTA (A/B runs)
    const char* value = std::getenv("MHLA_MIX_GRID");
    return value == nullptr || std::strcmp(value, "resident") != 0;
  }();
  while (coprime && grid > 1 && grid < items && std::gcd(grid, columns) != 1) --grid;
  return grid;
}

// Launched as a dependent grid (common/dependent_launch.cuh). The items are walked last to first
// (MHLA_MIX_ORDER=forward: first to last, for A/B runs): the pass before the mix wrote its states
// first to last, so the last of them are the ones still in L2, and the pass after it reads the
// mix's output first to last, so the mix's last writes are its first reads.
template <bool Backward, bool Staged = true>
cudaError_t launch(PackedMix p, int multiprocessors, cudaStream_t stream) {
  const int64_t grid = grid_for<Backward, Staged>(p, multiprocessors);
  if (grid == 0) return cudaSuccess;
  if (grid < 0) return cudaErrorInvalidConfiguration;
  static const bool reverse = [] {
    const char* value = std::getenv("MHLA_MIX_ORDER");
    return value == nullptr || std::strcmp(value, "forward") != 0;
  }();
  p.reverse = reverse;
  constexpr auto kernel = packed_mix_kernel<Backward, Staged>;
  return dependent_launch::launch(kernel, dim3(static_cast<unsigned>(grid)), dim3(kThreads),
                                  Stage<Backward>::shared_bytes, stream, p);
}

}  // namespace packed_mix
}  // namespace mhla_kernels
