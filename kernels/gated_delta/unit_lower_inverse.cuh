#pragma once
// The inverse of a chunk's unit lower-triangular WY system, shared by the gated DeltaNet and KDA
// prepare passes.
#include "gated_delta/chunk_tiles.cuh"

namespace mhla_kernels {
namespace gated_delta {

// t = (I + A)^-1 for a strictly lower A (fp32 [64][68] tiles) in 16 x 16 blocks: the four
// diagonal blocks by forward substitution (a thread per column), then the blocks below them a
// diagonal at a time, T_ij = -T_ii sum_{k=j}^{i-1} A_ik T_kj (y: scratch of 3 x 16 x 16 fp32).
// Chains of 16 rather than 64 dependent rows. Ends synchronized.
template <int Threads>
__device__ void invert_unit_lower(const float* a, float* t, float* y) {
  constexpr int kB = 16;
  for (int e = threadIdx.x; e < kC * kC; e += Threads) t[(e / kC) * kLdSquare + e % kC] = 0.f;
  __syncthreads();
  if (threadIdx.x < kC) {
    const int base = kB * (threadIdx.x / kB), j = threadIdx.x % kB;
    float x[kB];
#pragma unroll
    for (int i = 0; i < kB; ++i) {
      float acc = i == j ? 1.f : 0.f;
#pragma unroll
      for (int s = 0; s < i; ++s) acc -= a[(base + i) * kLdSquare + base + s] * x[s];
      x[i] = acc;
    }
#pragma unroll
    for (int i = 0; i < kB; ++i) t[(base + i) * kLdSquare + base + j] = x[i];
  }
  __syncthreads();
  for (int d = 1; d < kC / kB; ++d) {
    const int blocks = kC / kB - d;
    for (int e = threadIdx.x; e < blocks * kB * kB; e += Threads) {
      const int j = e / (kB * kB), i = j + d, r = (e / kB) % kB, c = e % kB;
      float sum = 0.f;
      for (int m = kB * j; m < kB * i; ++m)
        sum += a[(kB * i + r) * kLdSquare + m] * t[m * kLdSquare + kB * j + c];
      y[e] = sum;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < blocks * kB * kB; e += Threads) {
      const int j = e / (kB * kB), i = j + d, r = (e / kB) % kB, c = e % kB;
      float sum = 0.f;
#pragma unroll
      for (int m = 0; m < kB; ++m) {
        sum += t[(kB * i + r) * kLdSquare + kB * i + m] * y[j * kB * kB + m * kB + c];
      }
      t[(kB * i + r) * kLdSquare + kB * j + c] = -sum;
    }
    __syncthreads();
  }
}

}  // namespace gated_delta
}  // namespace mhla_kernels
