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

#include <cuda_bf16.h>

#include "common/device_info.h"
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

// Four bf16 (8 bytes of a packed set's matrix part in shared memory) as four floats.
__device__ __forceinline__ float4 bf16_quad(const __nv_bfloat16* at) {
  const uint2 bits = *reinterpret_cast<const uint2*>(at);
  return make_float4(__uint_as_float(bits.x << 16), __uint_as_float(bits.x & 0xffff0000u),
                     __uint_as_float(bits.y << 16), __uint_as_float(bits.y & 0xffff0000u));
}

__device__ __forceinline__ float dot4(const float4& a, const float4& b, float acc) {
  return fmaf(a.w, b.w, fmaf(a.z, b.z, fmaf(a.y, b.y, fmaf(a.x, b.x, acc))));
}

// Packed: dS' and S are packed sets (block_linear_attention.h: the matrix part bf16, the rest
// fp32). An item of the matrix part covers two fp32 items' columns (2 * S::columns elements) as
// bf16 rows, the same bytes per stage, and is computed as two halves; items of the fp32 rest
// copy as the fp32 layout does. Call 1 of session 27 gave packed items one fp32 item's columns:
// half the bytes in flight per CTA, and the kernel (latency-bound) took 92 against 80 us at
// B = 64, N = 1,024, H = 6, D = 64, M = 16.
template <int Rows, bool Packed>
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
  const int64_t matrix = Packed ? p.packed_inputs_matrix : 0;  // a multiple of 2 * S::columns
  const int64_t matrix_items = matrix / (2 * S::columns);
  // Items per batch*head: the packed matrix part's, then the fp32 part's.
  const int64_t columns = matrix_items + (p.elements - matrix + S::columns - 1) / S::columns;
  const int64_t items = static_cast<int64_t>(p.batch_heads) * columns;
  // An item's first element (the index of the item within its batch*head given).
  auto first_element = [&](int64_t index) {
    return index < matrix_items ? index * 2 * S::columns
                                : matrix + (index - matrix_items) * S::columns;
  };
  // A state's row in floats, and where element e (>= matrix) of state (bh, r) starts.
  const int64_t row_floats = matrix / 2 + p.elements - matrix;
  auto fp32_at = [&](int64_t bh, int r, int64_t e) {
    return (static_cast<size_t>(bh) * p.blocks + r) * row_floats + matrix / 2 + (e - matrix);
  };
  // Thread t copies rows role, role + roles, ... of its quad, of dS' and of S.
  auto issue = [&](int64_t item, int stage) {
    const int64_t bh = item / columns, e0 = first_element(item % columns);
    if (Packed && e0 < matrix) {  // bf16 rows: [dS' rows][S rows] of 2 * S::columns elements
      constexpr int kPiecesPerRow = 2 * S::columns / 8, kPieces = 2 * Rows * kPiecesPerRow;
      static_assert(kPieces % kThreads == 0, "whole pieces per thread");
      char* dst = reinterpret_cast<char*>(stages + stage * S::stage_quads);
#pragma unroll
      for (int u = 0; u < kPieces / kThreads; ++u) {
        const int piece = t + kThreads * u;
        const int tensor = piece / (Rows * kPiecesPerRow);
        const int r = (piece / kPiecesPerRow) % Rows, column = piece % kPiecesPerRow;
        const bool in = r < p.blocks;
        const float* rows = tensor == 0 ? p.grad_mixed : p.states;
        const __nv_bfloat16* src =
            reinterpret_cast<const __nv_bfloat16*>(
                rows + (static_cast<size_t>(bh) * p.blocks + (in ? r : 0)) * row_floats) +
            e0 + 8 * column;
        copy_16(dst + 16 * piece, src, in);
      }
    } else {
      const int64_t e = e0 + 4 * q;
      float4* dst = stages + stage * S::stage_quads + q;
#pragma unroll
      for (int u = 0; u < Rows / S::roles; ++u) {
        const int r = role + S::roles * u;
        const bool in = r < p.blocks && e < p.elements;
        const size_t at = in ? fp32_at(bh, r, e) : 0;
        copy_16(dst + r * S::quads, p.grad_mixed + at, in);
        copy_16(dst + (Rows + r) * S::quads, p.states + at, in);
      }
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
    const int64_t bh = item / columns, e0 = first_element(item % columns);
    const bool bf16_item = Packed && e0 < matrix;  // the same for every thread of the item
    const int halves = bf16_item ? 2 : 1;
#pragma unroll 1
    for (int half = 0; half < halves; ++half) {
      const int64_t e = e0 + half * S::columns + 4 * q;
      // Row i of dS' (tensor 0) or S (1) at this thread's quad, from either stage layout.
      const __nv_bfloat16* packed_rows =
          reinterpret_cast<const __nv_bfloat16*>(x) + half * S::columns + 4 * q;
      auto quad = [&](int tensor, int i) {
        if (bf16_item) return bf16_quad(packed_rows + (tensor * Rows + i) * 2 * S::columns);
        return (tensor == 0 ? x : y)[i * S::quads + q];
      };
      // dS_j for this thread's rows j: sum over i of m_ij dS'_i.
      float4 out[S::out_rows] = {};
#pragma unroll 4
      for (int i = 0; i < Rows; ++i) {
        const float4 xi = quad(0, i);
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
      for (int a = 0; a < 4; ++a) own[a] = quad(0, row0 + a);
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        const float4 yj = quad(1, col0 + j);
#pragma unroll
        for (int a = 0; a < 4; ++a) dm[a][j] = dot4(own[a], yj, dm[a][j]);
      }
    }                 // half
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

template <int Rows, bool Packed>
cudaError_t launch(const BlockMixBackward& p, cudaStream_t stream) {
  using S = MixShape<Rows>;
  constexpr auto kernel = mix_backward_kernel<Rows, Packed>;
  if (Packed && p.packed_inputs_matrix % (2 * S::columns) != 0) return cudaErrorInvalidValue;
  cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, S::shared_bytes);
  if (err != cudaSuccess) return err;
  int per_sm = 0;
  if ((err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads,
                                                           S::shared_bytes)) != cudaSuccess)
    return err;
  const int64_t matrix = Packed ? p.packed_inputs_matrix : 0;
  const int64_t items =
      static_cast<int64_t>(p.batch_heads) *
      (matrix / (2 * S::columns) + (p.elements - matrix + S::columns - 1) / S::columns);
  const int ctas = static_cast<int>(
      std::min<int64_t>(items, static_cast<int64_t>(std::max(per_sm, 1)) * multiprocessors()));
  kernel<<<ctas, kThreads, S::shared_bytes, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

bool block_mix_backward_supported(int blocks, int64_t elements) {
  return blocks >= 1 && blocks <= kMixBackwardMaxBlocks && elements > 0 && elements % 4 == 0;
}

cudaError_t block_mix_backward(const BlockMixBackward& p, cudaStream_t stream) {
  if (p.grad_mixed == nullptr || p.states == nullptr || p.mixing == nullptr ||
      p.grad_states == nullptr || p.grad_mixing == nullptr || p.batch_heads <= 0 ||
      !block_mix_backward_supported(p.blocks, p.elements) || p.packed_matrix < 0 ||
      p.packed_matrix % 8 != 0 || p.packed_matrix > p.elements || p.packed_inputs_matrix < 0 ||
      (p.packed_inputs_matrix > 0 && p.packed_inputs_matrix != p.packed_matrix))
    return cudaErrorInvalidValue;
  if (p.packed_inputs_matrix > 0)
    return p.blocks <= 16 ? launch<16, true>(p, stream) : launch<32, true>(p, stream);
  return p.blocks <= 16 ? launch<16, false>(p, stream) : launch<32, false>(p, stream);
}

}  // namespace mhla_kernels
