// Prepare pass of the fused gated DeltaNet: per chunk, the gate sums G, the WY system
// A_rs = beta_r (k_r . k_s) exp(G_r - G_s) (s < r), its inverse T = (I + A)^-1 (kept for the
// backward) and W = T diag(beta exp(G)) K, U0 = T diag(beta) V. One CTA per (chunk, batch x
// head): K K^T on tensor cores, T in fp32 by 16 x 16 blocks (invert_unit_lower), the two
// products with T (in the element type) on tensor cores.
#include "gated_delta/chunk_passes.h"
#include "gated_delta/chunk_tiles.cuh"
#include "gated_delta/unit_lower_inverse.cuh"

namespace mhla_kernels {
namespace gated_delta {
namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;

template <int D>
struct PrepareLayout {
  static constexpr int ld_wide = 2 * D + 8;                  // [K | V] rows, element type
  static constexpr size_t a = 0;                             // f32 [64][68]
  static constexpr size_t staging = a + 4 * kC * kLdSquare;  // f32 [64][D + 4]
  // Also T (fp32 [64][68]) and the blocked inversion's scratch (3 x 16 x 16) before that.
  static constexpr size_t staging_floats =
      kC * Ld<D>::f > kC* kLdSquare + 768 ? kC* Ld<D>::f : kC* kLdSquare + 768;
  static constexpr size_t g = staging + 4 * staging_floats;  // f32 [64]
  static constexpr size_t beta = g + 4 * kC;                 // f32 [64]
  static constexpr size_t x = beta + 4 * kC;                 // [64][2D + 8]: K | V, then X
  static constexpr size_t t = x + 2 * kC * ld_wide;          // [64][72]: T
  static constexpr size_t bytes = t + 2 * kC * kLdSquareE;
};

template <typename T, int D>
__global__ void __launch_bounds__(kThreads, 2) prepare_kernel(GatedDeltaArgs p) {
  using L = PrepareLayout<D>;
  extern __shared__ __align__(128) unsigned char raw[];
  float* a = reinterpret_cast<float*>(raw + L::a);
  float* staging = reinterpret_cast<float*>(raw + L::staging);
  float* g = reinterpret_cast<float*>(raw + L::g);
  float* beta = reinterpret_cast<float*>(raw + L::beta);
  T* x = reinterpret_cast<T*>(raw + L::x);
  T* t_s = reinterpret_cast<T*>(raw + L::t);
  const ChunkPosition at = block_chunk(p);
  load_token_rows<T, D, kThreads>(x, L::ld_wide, p.k, p, at);
  load_token_rows<T, D, kThreads>(x + D, L::ld_wide, p.v, p, at);
  if (threadIdx.x < kC) {
    const int r = threadIdx.x;
    const int64_t i = at.token(r, 1, p.heads, p.tokens);
    g[r] = r < at.valid ? p.gate[i] : 0.f;
    beta[r] = r < at.valid ? p.beta[i] : 0.f;
  }
  finish_loads();
  __syncthreads();
  if (threadIdx.x < 32) warp_running_sum64(g);
  gemm<T, kWarps, false, true, kWarps / 2>(x, L::ld_wide, x, L::ld_wide, a, kLdSquare, kC, kC, D,
                                           false);
  __syncthreads();
  if (threadIdx.x < kC) {
    p.gate_sums[(static_cast<int64_t>(at.bh) * at.chunks + at.chunk) * kC + threadIdx.x] =
        g[threadIdx.x];
  }
  for (int e = threadIdx.x; e < kC * kC / 4; e += kThreads) {
    const int r = e / (kC / 4), s0 = 4 * (e % (kC / 4));
    float4& y = *reinterpret_cast<float4*>(a + r * kLdSquare + s0);
    const float b = beta[r], gr = g[r];
    float4 v = y;
    v.x = s0 < r ? b * v.x * __expf(gr - g[s0]) : 0.f;
    v.y = s0 + 1 < r ? b * v.y * __expf(gr - g[s0 + 1]) : 0.f;
    v.z = s0 + 2 < r ? b * v.z * __expf(gr - g[s0 + 2]) : 0.f;
    v.w = s0 + 3 < r ? b * v.w * __expf(gr - g[s0 + 3]) : 0.f;
    y = v;
  }
  // X = [diag(beta exp(G)) K | diag(beta) V] in place.
  for (int e = threadIdx.x; e < kC * (2 * D / 8); e += kThreads) {
    const int r = e / (2 * D / 8), c = 8 * (e % (2 * D / 8));
    const float f = c < D ? beta[r] * __expf(g[r]) : beta[r];
    float y[8];
    load_pack<T, 8>(x + r * L::ld_wide + c, y);
#pragma unroll
    for (int j = 0; j < 8; ++j) y[j] *= f;
    store_pack<T, 8>(x + r * L::ld_wide + c, y);
  }
  __syncthreads();
  invert_unit_lower<kThreads>(a, staging, staging + kC * kLdSquare);
  keep_inverse<T, kThreads>(staging, t_s, static_cast<T*>(p.t_inverse) + at.tile(0, kC));
  __syncthreads();
  for (int half = 0; half < 2; ++half) {
    gemm<T, kWarps, false, false, kWarps / 2>(t_s, kLdSquareE, x + half * D, L::ld_wide, staging,
                                              Ld<D>::f, kC, D, kC, false);
    __syncthreads();
    T* dst = static_cast<T*>(half == 0 ? p.w : p.u0) + at.tile(0, D);
    store_rows<T, D, kThreads>([&](int r) { return dst + r * D; }, staging, Ld<D>::f, kC);
    __syncthreads();
  }
}

template <typename T, int D>
struct Prepare {
  static cudaError_t launch(const GatedDeltaArgs& a, cudaStream_t stream) {
    return launch_pass(prepare_kernel<T, D>, chunk_grid(a), kThreads, PrepareLayout<D>::bytes, a,
                       stream);
  }
};

}  // namespace

cudaError_t run_prepare(const GatedDeltaArgs& a, cudaStream_t stream) {
  return dispatch<Prepare>(a, stream);
}

}  // namespace gated_delta
}  // namespace mhla_kernels
