#pragma once
// The inverse of a chunk's unit lower-triangular WY system, shared by the gated DeltaNet and KDA
// prepare passes.
#include "gated_delta/chunk_tiles.cuh"

namespace mhla_kernels {
namespace gated_delta {

// t = (I + A)^-1 for a strictly lower A (fp32 [64][68] tiles) in 16 x 16 blocks: the four
// diagonal blocks by forward substitution (a thread per column), then the blocks below them a
// diagonal at a time, T_ij = -T_ii sum_{k=j}^{i-1} A_ik T_kj (y: scratch of 3 x 16 x 16 fp32).
// Chains of 16 rather than 64 dependent rows. The substitution is right-looking (each solved
// x_s is subtracted from every later row's accumulator at once), so its dependent chain is one
// multiply-add per row instead of the whole row's dot product; the block products keep four
// partial sums. Ends synchronized.
template <int Threads>
__device__ void invert_unit_lower(const float* a, float* t, float* y) {
  constexpr int kB = 16;
  for (int e = threadIdx.x; e < kC * kC / 4; e += Threads) {
    *reinterpret_cast<float4*>(t + (e / (kC / 4)) * kLdSquare + 4 * (e % (kC / 4))) = float4{};
  }
  __syncthreads();
  if (threadIdx.x < kC) {
    const int base = kB * (threadIdx.x / kB), j = threadIdx.x % kB;
    float x[kB];
#pragma unroll
    for (int i = 0; i < kB; ++i) x[i] = i == j ? 1.f : 0.f;
#pragma unroll
    for (int s = 0; s < kB; ++s) {  // x_s is final here
#pragma unroll
      for (int i = s + 1; i < kB; ++i) x[i] -= a[(base + i) * kLdSquare + base + s] * x[s];
    }
#pragma unroll
    for (int i = 0; i < kB; ++i) t[(base + i) * kLdSquare + base + j] = x[i];
  }
  __syncthreads();
  for (int d = 1; d < kC / kB; ++d) {
    const int blocks = kC / kB - d;
    for (int e = threadIdx.x; e < blocks * kB * kB; e += Threads) {
      const int j = e / (kB * kB), i = j + d, r = (e / kB) % kB, c = e % kB;
      float sum[4] = {0.f, 0.f, 0.f, 0.f};
      for (int m = kB * j; m < kB * i; m += 4) {
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          sum[q] += a[(kB * i + r) * kLdSquare + m + q] * t[(m + q) * kLdSquare + kB * j + c];
        }
      }
      y[e] = (sum[0] + sum[1]) + (sum[2] + sum[3]);
    }
    __syncthreads();
    for (int e = threadIdx.x; e < blocks * kB * kB; e += Threads) {
      const int j = e / (kB * kB), i = j + d, r = (e / kB) % kB, c = e % kB;
      float sum[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int m = 0; m < kB; m += 4) {
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          sum[q] +=
              t[(kB * i + r) * kLdSquare + kB * i + m + q] * y[j * kB * kB + (m + q) * kB + c];
        }
      }
      t[(kB * i + r) * kLdSquare + kB * j + c] = -((sum[0] + sum[1]) + (sum[2] + sum[3]));
    }
    __syncthreads();
  }
}

// The inverse from fp32 t (as invert_unit_lower leaves it) in the element type, into the
// product operand t_s (shared, [64][72]) and the t_inverse buffer the backward reads (t_out,
// [64][64]). Not synchronized.
template <typename T, int Threads>
__device__ void keep_inverse(const float* t, T* t_s, T* t_out) {
  for (int e = threadIdx.x; e < kC * kC / 8; e += Threads) {
    const int r = e / (kC / 8), c = 8 * (e % (kC / 8));
    float y[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) y[j] = t[r * kLdSquare + c + j];
    store_pack<T, 8>(t_s + r * kLdSquareE + c, y);
    store_pack<T, 8>(t_out + r * kC + c, y);
  }
}

}  // namespace gated_delta
}  // namespace mhla_kernels
