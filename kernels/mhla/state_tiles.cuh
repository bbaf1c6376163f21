#pragma once
// Tensor-core products on D x D fp32 block states, shared by the bidirectional and the causal
// block-linear-attention kernels: A^T B accumulated into a state, tile x state products, and a
// state's trip between global memory (fp32) and shared memory (the tensor-core element type).
#include <cstdint>

#include "common/packed_access.cuh"
#include "mhla/tiles.cuh"

namespace mhla_kernels {
namespace tiles {

// acc (D x D, fragments spread over the warps) += A^T B for A, B tiles [rows][D].
template <typename T, int D, int Threads = kThreads>
__device__ __forceinline__ void accumulate_at_b(
    FragC<T> (&acc)[Layout<T, D, Threads>::frags_per_warp], const typename Mma<T>::elem* a,
    const typename Mma<T>::elem* b, int rows) {
  using L = Layout<T, D, Threads>;
  constexpr int kWarps = Threads / 32;
  const int warp = threadIdx.x / 32;
  for (int kk = 0; kk < rows; kk += Mma<T>::k) {
#pragma unroll
    for (int u = 0; u < L::frags_per_warp; ++u) {
      const int f = warp + u * kWarps;
      if (f < L::frags) {
        const int fm = f / (D / 16), fn = f % (D / 16);
        FragA<T, wmma::col_major> fa;
        FragB<T, wmma::row_major> fb;
        load_fragment<T>(fa, a + kk * L::lde + fm * 16, L::lde);
        load_fragment<T>(fb, b + kk * L::lde + fn * 16, L::lde);
        wmma::mma_sync(acc[u], fa, fb, acc[u]);
      }
    }
  }
}

// out [rows][D] (fp32, ldf) = A [rows][D] x B (D x D), with B transposed when Transposed.
template <typename T, int D, bool Transposed, int Threads = kThreads>
__device__ __forceinline__ void multiply_tile(const typename Mma<T>::elem* a,
                                              const typename Mma<T>::elem* b, float* out,
                                              int rows) {
  using L = Layout<T, D, Threads>;
  constexpr int kWarps = Threads / 32;
  using BLayout = std::conditional_t<Transposed, wmma::col_major, wmma::row_major>;
  const int warp = threadIdx.x / 32;
  const int count = (rows / 16) * (D / 16);
  for (int f = warp; f < count; f += kWarps) {
    const int fm = f / (D / 16), fn = f % (D / 16);
    FragC<T> acc;
    wmma::fill_fragment(acc, 0.f);
    for (int kk = 0; kk < D; kk += Mma<T>::k) {
      FragA<T, wmma::row_major> fa;
      FragB<T, BLayout> fb;
      load_fragment<T>(fa, a + fm * 16 * L::lde + kk, L::lde);
      if constexpr (Transposed) {
        load_fragment<T>(fb, b + fn * 16 * L::lde + kk, L::lde);
      } else {
        load_fragment<T>(fb, b + kk * L::lde + fn * 16, L::lde);
      }
      wmma::mma_sync(acc, fa, fb, acc);
    }
    wmma::store_matrix_sync(out + fm * 16 * L::ldf + fn * 16, acc, L::ldf, wmma::mem_row_major);
  }
}

// Writes the D x D accumulators to a state in global memory: stored when one CTA owns it,
// added atomically (through a per-warp staging tile) when several chunks share it.
template <typename T, int D, int Threads = kThreads>
__device__ void write_state(FragC<T> (&acc)[Layout<T, D, Threads>::frags_per_warp], float* state,
                            bool atomic, float* staging) {
  using L = Layout<T, D, Threads>;
  constexpr int kWarps = Threads / 32;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float* tile = staging + warp * 256;
#pragma unroll
  for (int u = 0; u < L::frags_per_warp; ++u) {
    const int f = warp + u * kWarps;
    if (f >= L::frags) continue;
    const int fm = f / (D / 16), fn = f % (D / 16);
    float* dst = state + fm * 16 * D + fn * 16;
    if (!atomic) {
      wmma::store_matrix_sync(dst, acc[u], D, wmma::mem_row_major);
    } else {
      wmma::store_matrix_sync(tile, acc[u], 16, wmma::mem_row_major);
      __syncwarp();
      for (int e = lane; e < 256; e += 32) atomicAdd(dst + (e / 16) * D + e % 16, tile[e]);
      __syncwarp();
    }
  }
}

// Loads a D x (D + 1) state (S, then z) into shared memory: S as tensor-core elements, z in fp32.
// Every block pass starts here, so the loads are 16 bytes wide and issued in batches before any
// store: the scalar load-convert-store loop this replaces waited one global-memory latency per
// element group (~20 us per CTA at D = 128, most of the causal output pass). A state starts at a
// multiple of D * (D + 1) floats, 16-byte aligned when its buffer is.
// MaxBatch bounds the float4 loads in flight per thread (registers: the lean causal passes hold
// their token rows in flight beside it).
template <typename T, int D, int Threads = kThreads, int MaxBatch = 16>
__device__ void load_state(const float* state, typename Mma<T>::elem* s, float* z) {
  using L = Layout<T, D, Threads>;
  constexpr int kThreads = Threads;
  using E = typename Mma<T>::elem;
  constexpr int kPerRow = D / 4, kCount = D * kPerRow;  // float4 groups of S
  constexpr int kPerThread = kCount / kThreads > 0 ? kCount / kThreads : 1;
  constexpr int kBatch = kPerThread < MaxBatch ? kPerThread : MaxBatch;
  if (reinterpret_cast<uintptr_t>(state) % 16 != 0) {  // not from a whole-state buffer
    for (int e = threadIdx.x; e < D * D; e += kThreads) {
      s[(e / D) * L::lde + e % D] = from_float<E>(state[e]);
    }
  } else {
    const float4* src = reinterpret_cast<const float4*>(state);
    for (int first = threadIdx.x; first < kCount; first += kBatch * kThreads) {
      float4 x[kBatch];
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int e = first + u * kThreads;
        if (e < kCount) x[u] = __ldg(src + e);
      }
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int e = first + u * kThreads;
        if (e < kCount) {
          const float v[4] = {x[u].x, x[u].y, x[u].z, x[u].w};
          store_pack<E, 4>(s + (e / kPerRow) * L::lde + (e % kPerRow) * 4, v);
        }
      }
    }
  }
  for (int e = threadIdx.x; e < D; e += kThreads) z[e] = state[D * D + e];
}

}  // namespace tiles
}  // namespace mhla_kernels
