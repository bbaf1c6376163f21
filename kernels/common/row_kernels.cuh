#pragma once
// What the one-warp-per-row kernels (LayerNorm, the adaLN hinge, gated RMSNorm, the short conv)
// share: the dispatch from a row length to the elements each lane holds, the alignment check their
// packed accesses need, a row's mean and inverse standard deviation, and the sum of per-CTA
// partial gradients in a fixed order (deterministic, no atomics).
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "common/packed_access.cuh"
#include "common/partial_sums.cuh"

namespace mhla_kernels {

// f(std::integral_constant<int, dim / 32>) for dim in {32, 64, 128, 256} up to kMaxDim.
template <int kMaxDim, typename F>
cudaError_t with_lanes_per_warp(int dim, F&& f) {
  switch (dim) {
    case 32:
      return f(std::integral_constant<int, 1>{});
    case 64:
      if constexpr (kMaxDim >= 64) return f(std::integral_constant<int, 2>{});
      break;
    case 128:
      if constexpr (kMaxDim >= 128) return f(std::integral_constant<int, 4>{});
      break;
    case 256:
      if constexpr (kMaxDim >= 256) return f(std::integral_constant<int, 8>{});
      break;
  }
  return cudaErrorInvalidValue;
}

// f(integral_constant VEC, integral_constant CHUNKS) for a row of `cols` held as CHUNKS x 32 x VEC
// values per warp: the fewest chunks that cover it (DiT-S's 384 columns take 3 chunks of 4-wide
// lanes), and for 1-wide rows (odd lengths, unaligned pointers) 8 chunks or enough for kMaxCols.
template <int kMaxCols, typename F>
cudaError_t with_row_chunks(int vec, int cols, F&& f) {
  using std::integral_constant;
  const int chunks = (cols + 32 * vec - 1) / (32 * vec);
  if (vec == 4) {
    if (chunks <= 1) return f(integral_constant<int, 4>{}, integral_constant<int, 1>{});
    if (chunks <= 2) return f(integral_constant<int, 4>{}, integral_constant<int, 2>{});
    if (chunks <= 3) return f(integral_constant<int, 4>{}, integral_constant<int, 3>{});
    if (chunks <= 4) return f(integral_constant<int, 4>{}, integral_constant<int, 4>{});
    if (chunks <= 6) return f(integral_constant<int, 4>{}, integral_constant<int, 6>{});
    return f(integral_constant<int, 4>{}, integral_constant<int, (kMaxCols + 127) / 128>{});
  }
  if (chunks <= 8) return f(integral_constant<int, 1>{}, integral_constant<int, 8>{});
  return f(integral_constant<int, 1>{}, integral_constant<int, (kMaxCols + 31) / 32>{});
}

// The mean and 1 / sqrt(variance + eps) of a row of `cols` held as kChunks x VEC values per lane
// (column (c * 32 + lane) * VEC + i; the values past the row's end are not read).
template <int VEC, int kChunks>
__device__ __forceinline__ void row_moments(const float (&values)[kChunks][VEC], int lane, int cols,
                                            float eps, float& mean, float& rstd) {
  float total = 0.f;
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    if ((c * 32 + lane) * VEC < cols) {
#pragma unroll
      for (int i = 0; i < VEC; ++i) total += values[c][i];
    }
  }
  mean = warp_sum(total) / cols;
  float squares = 0.f;
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    if ((c * 32 + lane) * VEC < cols) {
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        const float d = values[c][i] - mean;
        squares += d * d;
      }
    }
  }
  rstd = rsqrtf(warp_sum(squares) / cols + eps);
}

// Bytes of one element of a kernel dtype.
inline int dtype_bytes(DType t) {
  return t == DType::f32 ? 4 : 2;
}

inline bool is_aligned(const void* p, int bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

// out[i] = sum over c < ctas of partials[c * size + i], in a fixed order (common/partial_sums.cuh).
inline cudaError_t sum_cta_partials(const float* partials, int ctas, int64_t size, float* out,
                                    cudaStream_t stream) {
  if (size > 0x7fffffff) return cudaErrorInvalidValue;
  return sum_partials(partials, ctas, static_cast<int>(size), StoreInto{out}, stream);
}

}  // namespace mhla_kernels
