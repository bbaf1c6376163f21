// Prepare pass of the fused gated DeltaNet: per chunk, the gate sums G, the WY system
// A_rs = beta_r (k_r . k_s) exp(G_r - G_s) (s < r) and its solutions W = (I + A)^-1 diag(beta
// exp(G)) K and U0 = (I + A)^-1 diag(beta) V. One CTA per (chunk, batch x head); K K^T on tensor
// cores, then one thread per column of [K | V] solves the unit-lower system in registers (fp32).
#include "gated_delta/chunk_passes.h"
#include "gated_delta/chunk_tiles.cuh"

namespace mhla_kernels {
namespace gated_delta {
namespace {

constexpr int kThreads = 256;

template <int D>
constexpr size_t prepare_bytes() {
  return sizeof(float) * (kC * kLdSquare + 2 * kC) + 2 * kC * Ld<D>::e;
}

template <typename T, int D>
__global__ void __launch_bounds__(kThreads, 2) prepare_kernel(GatedDeltaArgs p) {
  extern __shared__ __align__(128) unsigned char raw[];
  float* a = reinterpret_cast<float*>(raw);  // [64][68]
  float* g = a + kC * kLdSquare;             // [64]
  float* beta = g + kC;                      // [64]
  T* ks = reinterpret_cast<T*>(beta + kC);   // [64][D + 8]
  const ChunkPosition at(p, blockIdx.y, blockIdx.x);
  const T* k = static_cast<const T*>(p.k);
  const T* v = static_cast<const T*>(p.v);
  load_rows<T, D, kThreads>(
      ks, Ld<D>::e, [&](int r) { return k + at.token(r, D, p.heads, p.tokens); }, at.valid,
      nullptr);
  if (threadIdx.x < kC) {
    const int r = threadIdx.x;
    const int64_t i = at.token(r, 1, p.heads, p.tokens);
    g[r] = r < at.valid ? p.gate[i] : 0.f;
    beta[r] = r < at.valid ? p.beta[i] : 0.f;
  }
  __syncthreads();
  if (threadIdx.x < 32) warp_running_sum64(g);
  gemm<T, kThreads / 32, false, true>(ks, Ld<D>::e, ks, Ld<D>::e, a, kLdSquare, kC, kC, D, false);
  __syncthreads();
  if (threadIdx.x < kC) {
    p.gate_sums[(static_cast<int64_t>(at.bh) * at.chunks + at.chunk) * kC + threadIdx.x] =
        g[threadIdx.x];
  }
  for (int e = threadIdx.x; e < kC * kC; e += kThreads) {
    const int r = e / kC, s = e % kC;
    float& x = a[r * kLdSquare + s];
    x = s < r ? beta[r] * x * __expf(g[r] - g[s]) : 0.f;
  }
  __syncthreads();
  // Column c of [diag(beta exp(G)) K | diag(beta) V] through (I + A)^-1.
  for (int c = threadIdx.x; c < 2 * D; c += kThreads) {
    float x[kC];
    if (c < D) {
#pragma unroll
      for (int r = 0; r < kC; ++r) x[r] = beta[r] * __expf(g[r]) * to_float(ks[r * Ld<D>::e + c]);
    } else {
#pragma unroll
      for (int r = 0; r < kC; ++r) {
        x[r] =
            r < at.valid ? beta[r] * to_float(v[at.token(r, D, p.heads, p.tokens) + c - D]) : 0.f;
      }
    }
    forward_substitute(a, x);
    T* out = static_cast<T*>(c < D ? p.w : p.u0) + at.tile(0, D) + (c < D ? c : c - D);
#pragma unroll
    for (int r = 0; r < kC; ++r) out[r * D] = from_float<T>(x[r]);
  }
}

template <typename T, int D>
struct Prepare {
  static cudaError_t launch(const GatedDeltaArgs& a, cudaStream_t stream) {
    constexpr size_t bytes = prepare_bytes<D>();
    if (cudaError_t err = allow_shared(prepare_kernel<T, D>, bytes); err != cudaSuccess) return err;
    const dim3 grid(gated_delta_chunks(a.tokens), a.batch * a.heads);
    prepare_kernel<T, D><<<grid, kThreads, bytes, stream>>>(a);
    return cudaGetLastError();
  }
};

}  // namespace

cudaError_t run_prepare(const GatedDeltaArgs& a, cudaStream_t stream) {
  return dispatch<Prepare>(a, stream);
}

}  // namespace gated_delta
}  // namespace mhla_kernels
