#pragma once
// What the one-warp-per-vector kernels (gated RMSNorm, the short conv) share: the dispatch from a
// vector length to the elements each lane holds, the alignment check their packed accesses need,
// and the sum of per-CTA partial weight gradients in a fixed order (deterministic, no atomics).
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

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

inline bool is_aligned(const void* p, int bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

// out[i] = sum over c < ctas of partials[c * size + i]. (A template only so that every file that
// includes this header may define it.)
template <typename Float = float>
__global__ void sum_cta_partials_kernel(const Float* partials, int ctas, int64_t size, Float* out) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= size) return;
  Float total = 0;
  for (int c = 0; c < ctas; ++c) total += partials[c * size + i];
  out[i] = total;
}

inline cudaError_t sum_cta_partials(const float* partials, int ctas, int64_t size, float* out,
                                    cudaStream_t stream) {
  sum_cta_partials_kernel<float><<<static_cast<unsigned>((size + 255) / 256), 256, 0, stream>>>(
      partials, ctas, size, out);
  return cudaGetLastError();
}

}  // namespace mhla_kernels
