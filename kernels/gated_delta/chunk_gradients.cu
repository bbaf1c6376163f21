// Per-chunk gradients of the fused gated DeltaNet that need the chunk's state S_i and the
// gradient dS_{i+1} of the state leaving it (from the states' backward pass). One CTA per (chunk,
// batch x head), products on tensor cores. With dO' = scale dO, P = (Q K^T) . D and the
// chunk's u and du (the total gradient of u):
//   dP^ = dO' u^T;  M = dP^ . D  (the gradient of the raw scores Q K^T)
//   dq  = exp(G) . (dO' S_i^T) + M K
//   dk' = M^T Q + exp(G_C - G) . (u dS_{i+1}^T)          (the WY pass adds its own part)
//   dW  = -du S_i^T
//   dG' = rowsum(dP^ . P) - colsum(dP^ . P) + exp(G) . rowsum(Q . (dO' S_i^T))
//         - exp(G_C - G) . rowsum(K . (u dS^T)), and at r = C - 1 (G_C) also
//         sum(exp(G_C - G) . rowsum(K . (u dS^T))) + exp(G_C) sum(S_i . dS_{i+1}).
#include <type_traits>

#include "gated_delta/chunk_passes.h"
#include "gated_delta/chunk_tiles.cuh"

namespace mhla_kernels {
namespace gated_delta {
namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;

template <int D>
constexpr size_t grads_bytes() {
  return sizeof(float) * (kC * kLdSquare + kC * Ld<D>::f + 5 * kC + 32) +
         2 * (5 * kC * Ld<D>::e + 2 * D * Ld<D>::e + kC * kLdSquareE);
}

// For each row r (a warp per row): returns sum_c x[r][c] r_f[r][c] through `reduce(r, sum)` and
// then scales the fp32 row r_f[r] by factor[r].
// Each lane takes D / 32 adjacent columns in one access per operand.
template <typename T, int D, typename Reduce>
__device__ void row_dot_then_scale(const T* x, float* r_f, const float* factor, Reduce reduce) {
  constexpr int kPer = D / 32;
  static_assert(kPer == 2 || kPer == 4, "D of 64 or 128");
  using Vec = std::conditional_t<kPer == 4, float4, float2>;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int r = warp; r < kC; r += kWarps) {
    alignas(16) float xs[kPer], ys[kPer];
    load_pack<T, kPer>(x + r * Ld<D>::e + kPer * lane, xs);
    Vec& row = *reinterpret_cast<Vec*>(r_f + r * Ld<D>::f + kPer * lane);
    *reinterpret_cast<Vec*>(ys) = row;
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < kPer; ++i) sum += xs[i] * ys[i];
    sum = warp_sum(sum);
    if (lane == 0) reduce(r, sum);
    const float f = factor[r];
#pragma unroll
    for (int i = 0; i < kPer; ++i) ys[i] *= f;
    row = *reinterpret_cast<const Vec*>(ys);
  }
}

template <typename T, int D>
__global__ void __launch_bounds__(kThreads) chunk_grads_kernel(GatedDeltaArgs p) {
  extern __shared__ __align__(128) unsigned char raw[];
  float* pf = reinterpret_cast<float*>(raw);    // [64][68]: scores, then dP^ . P
  float* r_f = pf + kC * kLdSquare;             // [64][D + 4]: dP^, then Y, Z, dW in turn
  float* g = r_f + kC * Ld<D>::f;               // [64]
  float* decay = g + kC;                        // [64]: scale exp(G_r)
  float* to_end = decay + kC;                   // [64]: exp(G_C - G_r)
  float* dg = to_end + kC;                      // [64]
  float* col = dg + kC;                         // [64]: column sums, then the K~ terms
  float* scratch = col + kC;                    // [32]
  T* q_s = reinterpret_cast<T*>(scratch + 32);  // [64][D + 8]
  T* k_s = q_s + kC * Ld<D>::e;
  T* do_s = k_s + kC * Ld<D>::e;  // dO (unscaled)
  T* u_s = do_s + kC * Ld<D>::e;
  T* du_s = u_s + kC * Ld<D>::e;
  T* st_s = du_s + kC * Ld<D>::e;  // [D][D + 8]: S_i
  T* ds_s = st_s + D * Ld<D>::e;   // [D][D + 8]: dS_{i+1}
  T* m_bf = ds_s + D * Ld<D>::e;   // [64][72]
  const ChunkPosition at(p, blockIdx.y, blockIdx.x);
  auto rows = [&](const void* base) {
    return [&at, &p, base](int r) {
      return static_cast<const T*>(base) + at.token(r, D, p.heads, p.tokens);
    };
  };
  load_rows<T, D, kThreads>(q_s, Ld<D>::e, rows(p.q), at.valid);
  load_rows<T, D, kThreads>(k_s, Ld<D>::e, rows(p.k), at.valid);
  load_rows<T, D, kThreads>(do_s, Ld<D>::e, rows(p.d_out), at.valid);  // dO; dO' = scale dO
  load_matrix<T, kC, D, kThreads>(u_s, Ld<D>::e, static_cast<const T*>(p.u) + at.tile(0, D), D);
  load_matrix<T, kC, D, kThreads>(du_s, Ld<D>::e, static_cast<const T*>(p.du) + at.tile(0, D), D);
  load_matrix<T, D, D, kThreads>(st_s, Ld<D>::e, static_cast<const T*>(p.states) + at.state(D), D);
  load_matrix<T, D, D, kThreads>(ds_s, Ld<D>::e, static_cast<const T*>(p.state_grads) + at.state(D),
                                 D);
  load_gate_sums(g, p, at);
  finish_loads();
  __syncthreads();
  if (threadIdx.x < kC) {
    decay[threadIdx.x] = p.scale * __expf(g[threadIdx.x]);
    to_end[threadIdx.x] = __expf(g[kC - 1] - g[threadIdx.x]);
  }
  gemm<T, kWarps, false, true>(q_s, Ld<D>::e, k_s, Ld<D>::e, pf, kLdSquare, kC, kC, D, false);
  gemm<T, kWarps, false, true>(do_s, Ld<D>::e, u_s, Ld<D>::e, r_f, kLdSquare, kC, kC, D, false);
  __syncthreads();
  for (int e = threadIdx.x; e < kC * kC / 8; e += kThreads) {  // 8 columns per thread
    const int r = e / (kC / 8), s0 = 8 * (e % (kC / 8));
    float m[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int s = s0 + j;
      float t = 0.f;
      m[j] = 0.f;
      if (s <= r) {
        const float d = __expf(g[r] - g[s]), dp = p.scale * r_f[r * kLdSquare + s];
        t = dp * pf[r * kLdSquare + s] * d;
        m[j] = dp * d;
      }
      pf[r * kLdSquare + s] = t;
    }
    store_pack<T, 8>(m_bf + r * kLdSquareE + s0, m);
  }
  __syncthreads();
  if (threadIdx.x < kC) {
    float sum = 0.f;
    for (int s = 0; s < kC; ++s) sum += pf[threadIdx.x * kLdSquare + s];
    dg[threadIdx.x] = sum;
  } else if (threadIdx.x < 2 * kC) {
    const int s = threadIdx.x - kC;
    float sum = 0.f;
    for (int r = 0; r < kC; ++r) sum += pf[r * kLdSquare + s];
    col[s] = sum;
  }
  // Y = dO S_i^T (the scale of dO' = scale dO rides with exp(G) in decay).
  gemm<T, kWarps, false, true>(do_s, Ld<D>::e, st_s, Ld<D>::e, r_f, Ld<D>::f, kC, D, D, false);
  __syncthreads();
  row_dot_then_scale<T, D>(q_s, r_f, decay,
                           [&](int r, float sum) { dg[r] += decay[r] * sum - col[r]; });
  __syncthreads();
  gemm<T, kWarps, false, false>(m_bf, kLdSquareE, k_s, Ld<D>::e, r_f, Ld<D>::f, kC, D, kC, true);
  __syncthreads();
  T* dq = static_cast<T*>(p.dq);
  store_rows<T, D, kThreads>([&](int r) { return dq + at.token(r, D, p.heads, p.tokens); }, r_f,
                             Ld<D>::f, at.valid);
  __syncthreads();
  // Z = u dS_{i+1}^T, the gradient of K~.
  gemm<T, kWarps, false, true>(u_s, Ld<D>::e, ds_s, Ld<D>::e, r_f, Ld<D>::f, kC, D, D, false);
  __syncthreads();
  row_dot_then_scale<T, D>(k_s, r_f, to_end, [&](int r, float sum) {
    const float t = to_end[r] * sum;
    dg[r] -= t;
    col[r] = t;
  });
  __syncthreads();
  gemm<T, kWarps, true, false>(m_bf, kLdSquareE, q_s, Ld<D>::e, r_f, Ld<D>::f, kC, D, kC, true);
  __syncthreads();
  float* dk_partial = p.dk_partial + at.tile(0, D);
  for (int e = threadIdx.x; e < kC * (D / 4); e += kThreads) {
    const int r = e / (D / 4), c = (e % (D / 4)) * 4;
    *reinterpret_cast<float4*>(dk_partial + r * D + c) =
        *reinterpret_cast<const float4*>(r_f + r * Ld<D>::f + c);
  }
  __syncthreads();
  gemm<T, kWarps, false, true>(du_s, Ld<D>::e, st_s, Ld<D>::e, r_f, Ld<D>::f, kC, D, D, false);
  float state_dot = 0.f;  // sum(S_i . dS_{i+1})
  for (int e = threadIdx.x; e < D * D; e += kThreads) {
    const int r = e / D, c = e % D;
    state_dot += to_float(st_s[r * Ld<D>::e + c]) * to_float(ds_s[r * Ld<D>::e + c]);
  }
  state_dot = block_sum<kThreads>(state_dot, scratch);  // synchronizes
  if (threadIdx.x == 0) {
    float k_terms = 0.f;
    for (int r = 0; r < kC; ++r) k_terms += col[r];
    dg[kC - 1] += k_terms + __expf(g[kC - 1]) * state_dot;
  }
  // dW in the element type: the WY backward only uses it as a tensor-core operand.
  T* dw = static_cast<T*>(p.dw) + at.tile(0, D);
  for (int e = threadIdx.x; e < kC * (D / 4); e += kThreads) {
    const int r = e / (D / 4), c = (e % (D / 4)) * 4;
    const float4 x = *reinterpret_cast<const float4*>(r_f + r * Ld<D>::f + c);
    store_pack<T, 4>(dw + r * D + c, {-x.x, -x.y, -x.z, -x.w});
  }
  __syncthreads();
  if (threadIdx.x < kC) {
    p.dgate_partial[(static_cast<int64_t>(at.bh) * at.chunks + at.chunk) * kC + threadIdx.x] =
        dg[threadIdx.x];
  }
}

template <typename T, int D>
struct ChunkGrads {
  static cudaError_t launch(const GatedDeltaArgs& a, cudaStream_t stream) {
    return launch_pass(chunk_grads_kernel<T, D>, chunk_grid(a), kThreads, grads_bytes<D>(), a,
                       stream);
  }
};

}  // namespace

cudaError_t run_chunk_grads(const GatedDeltaArgs& a, cudaStream_t stream) {
  return dispatch<ChunkGrads>(a, stream);
}

}  // namespace gated_delta
}  // namespace mhla_kernels
