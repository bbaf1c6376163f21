// dS_j = sum_i m_ij dS'_i and dm_ij += sum dS'_i * S_j in one pass (see block_mix_backward.h).
//
// Persistent CTAs walk items of (batch*head, column of the states). An item's rows of dS' and of S
// (padded to Rows = 16 or 32) are copied into shared memory with cp.async while the items before
// it are computed (a ring of stages). Thread t owns one four-element column quad and one role: a 4
// x 16 corner of dm (rows 4 * (role / halves), 16 columns from 16 * (role % halves)) kept in 64
// registers over every item (16 FMAs per row of S read), and Rows / roles rows of dS for its quad
// (4 FMAs per row of dS' read and row written). Rows past `blocks` and elements past the end are
// zero in shared memory, so they add nothing. At the end each corner is summed over its threads
// (shuffles, then shared memory) and added to grad_mixing once per CTA.
#include <algorithm>
#include <cstdlib>
#include <string>

#include <cuda_bf16.h>

#include "common/device_info.h"
#include "common/wmma_gemm.cuh"
#include "mhla/block_mix_backward.h"

namespace mhla_kernels {
namespace {

constexpr int kThreads = 256;

template <int Rows>
struct MixShape {
  static constexpr int halves = Rows / 16;              // 16-column halves of a dm row
  static constexpr int roles = (Rows / 4) * halves;     // dm corners: 4 (16) or 16 (32)
  static constexpr int quads = kThreads / roles;        // columns of four per item: 64 or 16
  static constexpr int columns = 4 * quads;             // elements per item: 256 or 64
  static constexpr int out_rows = Rows / roles;         // dS rows per thread: 4 or 2
  static constexpr int stage_quads = 2 * Rows * quads;  // dS' rows, then S rows: 32 or 16 KB
  // Stages in the ring: two (one item copying while one is computed). Three stages for 16 rows
  // and four for 32 were no faster (session 20, call 4: 95 against 87 us, 372 against 366 us).
  static constexpr int stages = 2;
  static constexpr size_t shared_bytes = static_cast<size_t>(stages) * stage_quads * 16;
  static_assert(kThreads % roles == 0 && (quads % 32 == 0 || quads == 16), "whole warps per role");
};

__device__ __forceinline__ void copy_16(void* dst, const void* src, bool in) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  // src-size 0 fills the 16 bytes with zeros (padding rows, elements past the end).
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(src),
               "r"(in ? 16 : 0));
}

__device__ __forceinline__ void fma4(float4& acc, float w, const float4& x) {
  acc.x = fmaf(w, x.x, acc.x);
  acc.y = fmaf(w, x.y, acc.y);
  acc.z = fmaf(w, x.z, acc.z);
  acc.w = fmaf(w, x.w, acc.w);
}

__device__ __forceinline__ float dot4(const float4& a, const float4& b, float acc) {
  return fmaf(a.w, b.w, fmaf(a.z, b.z, fmaf(a.y, b.y, fmaf(a.x, b.x, acc))));
}

template <int Rows>
__global__ void __launch_bounds__(kThreads, 2) mix_backward_kernel(BlockMixBackward p) {
  using S = MixShape<Rows>;
  extern __shared__ __align__(16) float4 stages[];  // [S::stages][2][Rows][quads]
  __shared__ float weights[Rows][Rows];             // zero outside the matrix
  __shared__ float corner[kThreads / 32][4][16];    // per-warp sums of the dm corners
  const int t = threadIdx.x, q = t % S::quads, role = t / S::quads;
  const int row0 = 4 * (role / S::halves), col0 = 16 * (role % S::halves);
  const int out0 = role * S::out_rows;  // first dS row of this thread
  for (int e = t; e < Rows * Rows; e += kThreads) {
    const int i = e / Rows, j = e % Rows;
    weights[i][j] = i < p.blocks && j < p.blocks ? p.mixing[i * p.blocks + j] : 0.f;
  }
  const int64_t columns = (p.elements + S::columns - 1) / S::columns;
  const int64_t items = static_cast<int64_t>(p.batch_heads) * columns;
  // Thread t copies rows role, role + roles, ... of its quad, of dS' and of S.
  auto issue = [&](int64_t item, int stage) {
    const int64_t bh = item / columns, e = (item % columns) * S::columns + 4 * q;
    const size_t base = static_cast<size_t>(bh) * p.blocks * p.elements;
    float4* dst = stages + stage * S::stage_quads + q;
#pragma unroll
    for (int u = 0; u < Rows / S::roles; ++u) {
      const int r = role + S::roles * u;
      const bool in = r < p.blocks && e < p.elements;
      const size_t at = base + (in ? static_cast<size_t>(r) * p.elements + e : 0);
      copy_16(dst + r * S::quads, p.grad_mixed + at, in);
      copy_16(dst + (Rows + r) * S::quads, p.states + at, in);
    }
    asm volatile("cp.async.commit_group;\n" ::);
  };
  float dm[4][16];
#pragma unroll
  for (int a = 0; a < 4; ++a) {
#pragma unroll
    for (int j = 0; j < 16; ++j) dm[a][j] = 0.f;
  }
  // A ring of stages: item n of this CTA lives in stage n % stages. Every iteration commits one
  // group (empty past the end), so "all but the newest stages - 1 groups" is always item n's.
  auto issue_or_empty = [&](int64_t item, int stage) {
    if (item < items)
      issue(item, stage);
    else
      asm volatile("cp.async.commit_group;\n" ::);
  };
  for (int s = 0; s + 1 < S::stages; ++s) issue_or_empty(blockIdx.x + int64_t{s} * gridDim.x, s);
  int stage = 0;
  for (int64_t item = blockIdx.x; item < items; item += gridDim.x) {
    // The stage before this one was last read before the previous trailing barrier.
    const int refill = stage == 0 ? S::stages - 1 : stage - 1;
    issue_or_empty(item + int64_t{S::stages - 1} * gridDim.x, refill);
    asm volatile("cp.async.wait_group %0;\n" ::"n"(S::stages - 1));
    __syncthreads();  // this item's copies (every thread's) and the weights are in
    const float4* x = stages + stage * S::stage_quads;  // dS' rows
    const float4* y = x + Rows * S::quads;              // S rows
    const int64_t bh = item / columns, e = (item % columns) * S::columns + 4 * q;
    // dS_j for this thread's rows j: sum over i of m_ij dS'_i.
    float4 out[S::out_rows] = {};
#pragma unroll 4
    for (int i = 0; i < Rows; ++i) {
      const float4 xi = x[i * S::quads + q];
#pragma unroll
      for (int a = 0; a < S::out_rows; ++a) fma4(out[a], weights[i][out0 + a], xi);
    }
    if (e < p.elements && p.packed_matrix == 0) {
      float* dst = p.grad_states + static_cast<size_t>(bh) * p.blocks * p.elements + e;
#pragma unroll
      for (int a = 0; a < S::out_rows; ++a) {
        const int j = out0 + a;
        if (j < p.blocks)
          *reinterpret_cast<float4*>(dst + static_cast<size_t>(j) * p.elements) = out[a];
      }
    } else if (e < p.elements) {  // packed: four bf16 (8 bytes) in the matrix part, else fp32
      const int64_t row = p.packed_matrix / 2 + p.elements - p.packed_matrix;
#pragma unroll
      for (int a = 0; a < S::out_rows; ++a) {
        const int j = out0 + a;
        if (j >= p.blocks) continue;
        float* state = p.grad_states + (static_cast<size_t>(bh) * p.blocks + j) * row;
        if (e < p.packed_matrix) {
          const __nv_bfloat162 pair[2] = {__floats2bfloat162_rn(out[a].x, out[a].y),
                                          __floats2bfloat162_rn(out[a].z, out[a].w)};
          *reinterpret_cast<uint2*>(reinterpret_cast<__nv_bfloat16*>(state) + e) =
              *reinterpret_cast<const uint2*>(pair);
        } else {
          *reinterpret_cast<float4*>(state + p.packed_matrix / 2 + e - p.packed_matrix) = out[a];
        }
      }
    }
    // dm_ij += dS'_i . S_j over this thread's corner.
    float4 own[4];
#pragma unroll
    for (int a = 0; a < 4; ++a) own[a] = x[(row0 + a) * S::quads + q];
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const float4 yj = y[(col0 + j) * S::quads + q];
#pragma unroll
      for (int a = 0; a < 4; ++a) dm[a][j] = dot4(own[a], yj, dm[a][j]);
    }
    __syncthreads();  // done with this stage before the next iteration refills it
    stage = stage + 1 == S::stages ? 0 : stage + 1;
  }
  asm volatile("cp.async.wait_group 0;\n" ::);  // no copy may land after the stages are reused
  // Sum the corners over the warp's lanes (every lane of a warp has the same role when quads is a
  // multiple of 32; with 16 quads a warp holds two roles, summed over their own 16 lanes), then
  // over the warps of a role.
  constexpr int kLanesPerRole = S::quads < 32 ? S::quads : 32;
  const int warp = t / 32, lane = t % 32;
#pragma unroll
  for (int a = 0; a < 4; ++a) {
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      float v = dm[a][j];
#pragma unroll
      for (int offset = kLanesPerRole / 2; offset > 0; offset /= 2)
        v += __shfl_xor_sync(0xffffffffu, v, offset);
      dm[a][j] = v;
    }
  }
  __syncthreads();  // the stages are free: per-role sums go there when a warp holds two roles
  float* role_sums = reinterpret_cast<float*>(stages);  // [roles][4][16]
  if constexpr (S::quads >= 32) {
    if (lane == 0) {
#pragma unroll
      for (int a = 0; a < 4; ++a) {
#pragma unroll
        for (int j = 0; j < 16; ++j) corner[warp][a][j] = dm[a][j];
      }
    }
    __syncthreads();
    constexpr int kWarpsPerRole = S::quads / 32;
    for (int e = t; e < S::roles * 64; e += kThreads) {
      const int r = e / 64, a = (e / 16) % 4, j = e % 16;
      float sum = 0.f;
      for (int w = 0; w < kWarpsPerRole; ++w) sum += corner[r * kWarpsPerRole + w][a][j];
      role_sums[e] = sum;
    }
  } else {
    if (q == 0) {  // the first lane of each role
#pragma unroll
      for (int a = 0; a < 4; ++a) {
#pragma unroll
        for (int j = 0; j < 16; ++j) role_sums[(role * 4 + a) * 16 + j] = dm[a][j];
      }
    }
  }
  __syncthreads();
  for (int e = t; e < S::roles * 64; e += kThreads) {
    const int r = e / 64, a = (e / 16) % 4, jj = e % 16;
    const int i = 4 * (r / S::halves) + a, j = 16 * (r % S::halves) + jj;
    if (i < p.blocks && j < p.blocks) atomicAdd(p.grad_mixing + i * p.blocks + j, role_sums[e]);
  }
}

// The bf16 matrix part of packed dS' and S (up to 16 blocks) on tensor cores: both are bf16
// already, so dm += dS' S^T is exact products with fp32 sums (mma.sync), and dS = m^T dS' takes
// m as bf16 high and low parts (fp32-accurate weights). Persistent CTAs of eight warps walk items
// of (batch*head, 512 columns); an item's 16 rows of dS' and of S are copied into a stage with
// cp.async while the item before it is computed. Warp w owns columns [64 w, 64 w + 64) of every
// item: four 16 x 16 output tiles of dS and a k-slice of dm (kept in one accumulator tile over
// all its items). Items of the fp32 rest (z, 64 columns each) run in the same loop on CUDA
// cores (as a second kernel they took 11.9 us of 71, session 27 call 3). The fp32 version of
// this loop (mix_backward_kernel on packed rows, call 2) was bound by its instruction count: 90
// against 80 us on fp32 states at B = 64, N = 1,024, H = 6, D = 64, M = 16.
namespace packed {

constexpr int kRows = 16, kColumns = 512, kWarps = kThreads / 32;
constexpr int kLd = kColumns + 8;  // bf16 per stage row: rows 16 bytes apart modulo 128
constexpr int kStageElements = 2 * kRows * kLd;  // dS' rows, then S rows
constexpr int kStages = 2;
constexpr int kWeightLd = kRows + 8;
// Items of the fp32 rest (z): 64 columns, fp32 rows of kRestLd floats in the stage.
constexpr int kRestColumns = 64, kRestLd = kRestColumns + 4;
static_assert(2 * kRows * kRestLd * 4 <= kStageElements * 2, "a rest item fits a stage");
static_assert(kRows * kRows == kThreads, "one dm pair per thread in rest items");
constexpr size_t kSharedBytes = static_cast<size_t>(kStages) * kStageElements * 2;
static_assert(kColumns == 64 * kWarps, "each warp owns 64 columns of an item");

// Staged: dS goes out through shared memory in 16-byte pieces (else 4-byte pairs from the
// accumulators; MHLA_MIX_BACKWARD_STORES=direct, for A/B runs): 42.9 against 61.3 us at the
// shape above (session 27, call 7).
template <bool Staged>
__global__ void __launch_bounds__(kThreads, 2)
    packed_matrix_mix_backward_kernel(BlockMixBackward p) {
  using wmma_tiles::TileAccumulator;
  extern __shared__ __align__(16) __nv_bfloat16 stage_rows[];  // [kStages][2][kRows][kLd]
  __shared__ __align__(16) __nv_bfloat16 weights_hi[kRows][kWeightLd], weights_lo[kRows][kWeightLd];
  __shared__ float weights[kRows][kRows];  // fp32, for rest items
  __shared__ float dm_sums[kWarps][kRows * kRows];
  const int t = threadIdx.x, warp = t / 32;
  for (int e = t; e < kRows * kRows; e += kThreads) {  // m = hi + lo, zero outside the matrix
    const int i = e / kRows, j = e % kRows;
    const float m = i < p.blocks && j < p.blocks ? p.mixing[i * p.blocks + j] : 0.f;
    weights[i][j] = m;
    const __nv_bfloat16 hi = __float2bfloat16_rn(m);
    weights_hi[i][j] = hi;
    weights_lo[i][j] = __float2bfloat16_rn(m - __bfloat162float(hi));
  }
  const int64_t matrix = p.packed_inputs_matrix;  // a multiple of kColumns
  const int64_t row_floats = matrix / 2 + p.elements - matrix;
  // Items per batch*head: the matrix part's, then the rest's (fp32, on CUDA cores).
  const int64_t matrix_items = matrix / kColumns;
  const int64_t columns = matrix_items + (p.elements - matrix + kRestColumns - 1) / kRestColumns;
  const int64_t items = static_cast<int64_t>(p.batch_heads) * columns;
  const int64_t out_row_floats = p.packed_matrix / 2 + p.elements - p.packed_matrix;
  auto row_of = [&](const float* set, int64_t bh, int r) {
    return reinterpret_cast<const __nv_bfloat16*>(set + (static_cast<size_t>(bh) * p.blocks + r) *
                                                            row_floats);
  };
  // Thread t copies 16-byte pieces t, t + 256, ... of the item's rows (rows past `blocks` zero).
  auto issue = [&](int64_t item, int stage) {
    if (item < items && item % columns >= matrix_items) {  // rest: fp32 pieces of 4 floats
      const int64_t bh = item / columns;
      const int64_t e0 = matrix + (item % columns - matrix_items) * kRestColumns;
      constexpr int kPiecesPerRow = kRestColumns / 4, kPieces = 2 * kRows * kPiecesPerRow;
      float* rest_rows = reinterpret_cast<float*>(stage_rows + stage * kStageElements);
#pragma unroll
      for (int u = 0; u < kPieces / kThreads; ++u) {
        const int piece = t + kThreads * u;
        const int row = piece / kPiecesPerRow, column = piece % kPiecesPerRow;  // row: [2][kRows]
        const int tensor = row / kRows, r = row % kRows;
        const int64_t e = e0 + 4 * column;
        const bool in = r < p.blocks && e < p.elements;
        const float* set = tensor == 0 ? p.grad_mixed : p.states;
        const float* src = set + (static_cast<size_t>(bh) * p.blocks + (in ? r : 0)) * row_floats +
                           matrix / 2 + (in ? e - matrix : 0);
        copy_16(rest_rows + row * kRestLd + 4 * column, src, in);
      }
    } else if (item < items) {
      const int64_t bh = item / columns, e0 = (item % columns) * kColumns;
      constexpr int kPiecesPerRow = kColumns / 8, kPieces = 2 * kRows * kPiecesPerRow;
#pragma unroll
      for (int u = 0; u < kPieces / kThreads; ++u) {
        const int piece = t + kThreads * u;
        const int row = piece / kPiecesPerRow, column = piece % kPiecesPerRow;  // row: [2][kRows]
        const int tensor = row / kRows, r = row % kRows;
        const bool in = r < p.blocks;
        const __nv_bfloat16* src =
            row_of(tensor == 0 ? p.grad_mixed : p.states, bh, in ? r : 0) + e0 + 8 * column;
        copy_16(stage_rows + stage * kStageElements + row * kLd + 8 * column, src, in);
      }
    }
    asm volatile("cp.async.commit_group;\n" ::);  // empty past the end: the group count holds
  };
  TileAccumulator dm;  // this warp's k-slices of dm, over all its matrix items
  dm.zero();
  float dm_rest = 0.f;  // pair (t / 16, t % 16) of dm over the rest items
  issue(blockIdx.x, 0);
  int stage = 0;
  for (int64_t item = blockIdx.x; item < items; item += gridDim.x) {
    issue(item + gridDim.x, stage ^ 1);  // that stage was last read before the trailing barrier
    asm volatile("cp.async.wait_group 1;\n" ::);
    __syncthreads();  // this item's rows (every thread's copies) and the weights are in
    if (item % columns >= matrix_items) {
      // Rest: thread t forms dS at column t % 64 for rows 4 (t / 64) to + 3, and dm's pair
      // (t / 16, t % 16) over the item's columns, all fp32.
      const float* rest_rows = reinterpret_cast<const float*>(stage_rows + stage * kStageElements);
      const int64_t bh = item / columns;
      const int64_t e0 = matrix + (item % columns - matrix_items) * kRestColumns;
      const int c = t % kRestColumns, j0 = 4 * (t / kRestColumns);
      float out[4] = {};
#pragma unroll
      for (int i = 0; i < kRows; ++i) {
        const float x = rest_rows[i * kRestLd + c];
#pragma unroll
        for (int a = 0; a < 4; ++a) out[a] = fmaf(weights[i][j0 + a], x, out[a]);
      }
      if (e0 + c < p.elements) {
#pragma unroll
        for (int a = 0; a < 4; ++a) {
          if (j0 + a < p.blocks) {
            p.grad_states[(static_cast<size_t>(bh) * p.blocks + j0 + a) * out_row_floats +
                          p.packed_matrix / 2 + (e0 + c - p.packed_matrix)] = out[a];
          }
        }
      }
      const float4* grad_row = reinterpret_cast<const float4*>(rest_rows + (t / kRows) * kRestLd);
      const float4* state_row =
          reinterpret_cast<const float4*>(rest_rows + (kRows + t % kRows) * kRestLd);
#pragma unroll
      for (int k = 0; k < kRestColumns / 4; ++k) dm_rest = dot4(grad_row[k], state_row[k], dm_rest);
      __syncthreads();  // done with this stage before the next iteration refills it
      stage ^= 1;
      continue;
    }
    const __nv_bfloat16* grad_rows = stage_rows + stage * kStageElements + 64 * warp;
    const __nv_bfloat16* state_rows = grad_rows + kRows * kLd;
    // dS = m^T dS' over this warp's 64 columns: A = m stored [i][j] (transposed), B = dS' [i][e].
    TileAccumulator out[1][4];
#pragma unroll
    for (int c = 0; c < 4; ++c) out[0][c].zero();
    wmma_tiles::mma_block<__nv_bfloat16, true, false, 1, 4>(out, &weights_hi[0][0], kWeightLd,
                                                            grad_rows, kLd, 0, 0, kRows);
    wmma_tiles::mma_block<__nv_bfloat16, true, false, 1, 4>(out, &weights_lo[0][0], kWeightLd,
                                                            grad_rows, kLd, 0, 0, kRows);
    // dm += dS' S^T over the same columns: A = dS' [i][e], B = S^T (S stored [j][e]).
    wmma_tiles::mma_tile<__nv_bfloat16, false, true>(dm, grad_rows, kLd, state_rows, kLd, 0, 0, 64);
    // dS rows j < blocks into the packed output, as bf16.
    const int64_t bh = item / columns, e0 = (item % columns) * kColumns + 64 * warp;
    auto out_row = [&](int j) {
      return reinterpret_cast<__nv_bfloat16*>(
                 p.grad_states + (static_cast<size_t>(bh) * p.blocks + j) * out_row_floats) +
             e0;
    };
    if constexpr (Staged) {
      // Through this warp's own dS' columns of the stage (only this warp reads them, and it is
      // done with them): each lane then stores whole 16-byte pieces, eight lanes a 128-byte row
      // segment, instead of 4-byte pairs that fill half of every 32-byte sector they touch.
      __nv_bfloat16* staged = const_cast<__nv_bfloat16*>(grad_rows);
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
        const int piece = lane + 32 * u, j = piece / 8, column = piece % 8;
        if (j < p.blocks) {
          *reinterpret_cast<uint4*>(out_row(j) + 8 * column) =
              *reinterpret_cast<const uint4*>(staged + j * kLd + 8 * column);
        }
      }
    } else {
#pragma unroll
      for (int i = 0; i < 4; i += 2) {
        const int j = TileAccumulator::row(i);
        if (j >= p.blocks) continue;
#pragma unroll
        for (int c = 0; c < 4; ++c) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            *reinterpret_cast<__nv_bfloat162*>(out_row(j) + 16 * c + TileAccumulator::col(h, i)) =
                __floats2bfloat162_rn(out[0][c].x[h][i], out[0][c].x[h][i + 1]);
          }
        }
      }
    }
    __syncthreads();  // done with this stage before the next iteration refills it
    stage ^= 1;
  }
  asm volatile("cp.async.wait_group 0;\n" ::);
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
    if (i < p.blocks && j < p.blocks) atomicAdd(p.grad_mixing + i * p.blocks + j, sum);
  }
}

}  // namespace packed

// Persistent CTAs: as many as fit on the GPU, at most one per item.
template <typename Kernel>
cudaError_t launch_persistent(Kernel kernel, size_t shared_bytes, int64_t items,
                              const BlockMixBackward& p, cudaStream_t stream) {
  if (items <= 0) return cudaSuccess;
  cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, shared_bytes);
  if (err != cudaSuccess) return err;
  int per_sm = 0;
  if ((err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads,
                                                           shared_bytes)) != cudaSuccess)
    return err;
  const int ctas = static_cast<int>(
      std::min<int64_t>(items, static_cast<int64_t>(std::max(per_sm, 1)) * multiprocessors()));
  kernel<<<ctas, kThreads, shared_bytes, stream>>>(p);
  return cudaGetLastError();
}

template <int Rows>
cudaError_t launch(const BlockMixBackward& p, cudaStream_t stream) {
  using S = MixShape<Rows>;
  return launch_persistent(
      mix_backward_kernel<Rows>, S::shared_bytes,
      static_cast<int64_t>(p.batch_heads) * ((p.elements + S::columns - 1) / S::columns), p,
      stream);
}

// Packed inputs: the matrix part and the rest in one kernel.
cudaError_t launch_packed(const BlockMixBackward& p, cudaStream_t stream) {
  const int64_t matrix = p.packed_inputs_matrix;
  const int64_t rest = (p.elements - matrix + packed::kRestColumns - 1) / packed::kRestColumns;
  const int64_t items = static_cast<int64_t>(p.batch_heads) * (matrix / packed::kColumns + rest);
  static const bool direct = [] {
    const char* value = std::getenv("MHLA_MIX_BACKWARD_STORES");
    return value != nullptr && std::string(value) == "direct";
  }();
  return direct ? launch_persistent(packed::packed_matrix_mix_backward_kernel<false>,
                                    packed::kSharedBytes, items, p, stream)
                : launch_persistent(packed::packed_matrix_mix_backward_kernel<true>,
                                    packed::kSharedBytes, items, p, stream);
}

}  // namespace

bool block_mix_backward_supported(int blocks, int64_t elements) {
  return blocks >= 1 && blocks <= kMixBackwardMaxBlocks && elements > 0 && elements % 4 == 0;
}

bool block_mix_backward_takes_packed(int blocks, int64_t packed_inputs_matrix) {
  if (packed_inputs_matrix == 0) return true;
  return packed_inputs_matrix > 0 && blocks >= 1 && blocks <= packed::kRows &&
         packed_inputs_matrix % packed::kColumns == 0;
}

cudaError_t block_mix_backward(const BlockMixBackward& p, cudaStream_t stream) {
  if (p.grad_mixed == nullptr || p.states == nullptr || p.mixing == nullptr ||
      p.grad_states == nullptr || p.grad_mixing == nullptr || p.batch_heads <= 0 ||
      !block_mix_backward_supported(p.blocks, p.elements) || p.packed_matrix < 0 ||
      p.packed_matrix % 8 != 0 || p.packed_matrix > p.elements ||
      !block_mix_backward_takes_packed(p.blocks, p.packed_inputs_matrix))
    return cudaErrorInvalidValue;
  if (p.packed_inputs_matrix > 0) {
    if (p.packed_inputs_matrix != p.packed_matrix) return cudaErrorInvalidValue;
    return launch_packed(p, stream);
  }
  return p.blocks <= 16 ? launch<16>(p, stream) : launch<32>(p, stream);
}

}  // namespace mhla_kernels
