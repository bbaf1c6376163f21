#pragma once
// The last step of the deterministic reductions (the weight and bias gradients of the layer
// norms, adaLN, the linear layers, the grid conv and the short conv): column sums of a
// [parts, width] fp32 matrix of per-CTA partials, added in a fixed order (no atomics, the same
// bits on every run).
//
// A CTA takes 32 consecutive columns; its warp g sums parts g, g + kPartialSumGroups, ... (reads
// coalesced across the lanes, kPartialSumUnroll loads in flight), then the warps' sums are added
// in warp order. The kernel this replaced ran one thread a column over every part in turn, one
// load after another: the layer norm's 1,024 parts of 384 columns took 19.8 us a call in
// session 34's DeiT-T/2 profile.
#include <cuda_runtime.h>

#include <cstdint>

namespace mhla_kernels {

inline constexpr int kPartialSumGroups = 16;  // warps per CTA, each over every 16th part
inline constexpr int kPartialSumUnroll = 4;

// store(column, total) writes each column's sum where the caller wants it.
template <typename Store>
__global__ void __launch_bounds__(32 * kPartialSumGroups)
    partial_sums_kernel(const float* partials, int parts, int width, Store store) {
  __shared__ float group_sums[kPartialSumGroups][32];
  const int lane = threadIdx.x % 32, group = threadIdx.x / 32;
  const int column = blockIdx.x * 32 + lane;
  float total = 0.f;
  if (column < width) {
    const float* at = partials + column;
    int p = group;
    for (; p + (kPartialSumUnroll - 1) * kPartialSumGroups < parts;
         p += kPartialSumUnroll * kPartialSumGroups) {
      float loaded[kPartialSumUnroll];
#pragma unroll
      for (int u = 0; u < kPartialSumUnroll; ++u)
        loaded[u] = at[static_cast<int64_t>(p + u * kPartialSumGroups) * width];
#pragma unroll
      for (int u = 0; u < kPartialSumUnroll; ++u) total += loaded[u];
    }
    for (; p < parts; p += kPartialSumGroups) total += at[static_cast<int64_t>(p) * width];
  }
  group_sums[group][lane] = total;
  __syncthreads();
  if (group != 0 || column >= width) return;
  total = 0.f;
#pragma unroll
  for (int g = 0; g < kPartialSumGroups; ++g) total += group_sums[g][lane];
  store(column, total);
}

// The plain store: column i's sum to out[i].
struct StoreInto {
  float* out;
  __device__ void operator()(int i, float total) const { out[i] = total; }
};

template <typename Store>
cudaError_t sum_partials(const float* partials, int parts, int width, Store store,
                         cudaStream_t stream) {
  if (width <= 0 || parts <= 0) return cudaErrorInvalidValue;
  partial_sums_kernel<<<(width + 31) / 32, 32 * kPartialSumGroups, 0, stream>>>(partials, parts,
                                                                                width, store);
  return cudaGetLastError();
}

}  // namespace mhla_kernels
