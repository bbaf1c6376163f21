// KDA backward, the per-chunk gradients that need the chunk's state S_i and the gradient dS_{i+1}
// of the state leaving it (from the states' backward pass), with du the total gradient of u:
//   dq  = dq_partial + exp(G) . (scale dO S_i^T)                    (final: written as dq)
//   dk' = dk_partial + exp(G_C - G) . (u dS_{i+1}^T)                (the WY passes add theirs)
//   dW  = -du S_i^T
//   dG += Q . exp(G) . (scale dO S_i^T) - K . exp(G_C - G) . (u dS^T), and on the last row G_C
//         also sum_t K . exp(G_C - G) . (u dS^T) + exp(G_C) . rowsum(S_i . dS_{i+1})
// One CTA per (chunk, batch x head); each thread keeps the same (row, key dimension) elements
// through the three products, so its dG terms stay in registers.
#include "gated_delta/chunk_passes.h"
#include "gated_delta/chunk_tiles.cuh"

namespace mhla_kernels {
namespace gated_delta {
namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;

template <int D>
struct StateGradsLayout {
  static constexpr size_t d_out = 0;                         // [64][D + 8]
  static constexpr size_t u = d_out + 2 * kC * Ld<D>::e;     // [64][D + 8]
  static constexpr size_t du = u + 2 * kC * Ld<D>::e;        // [64][D + 8]
  static constexpr size_t st = du + 2 * kC * Ld<D>::e;       // [D][D + 8]: S_i
  static constexpr size_t ds = st + 2 * D * Ld<D>::e;        // [D][D + 8]: dS_{i+1}
  static constexpr size_t result = ds + 2 * D * Ld<D>::e;    // f32 [64][D + 4]
  static constexpr size_t col = result + 4 * kC * Ld<D>::f;  // f32 [D]
  static constexpr size_t row_dot = col + 4 * D;             // f32 [D]
  static constexpr size_t bytes = row_dot + 4 * D;
};

template <typename T, int D>
__global__ void __launch_bounds__(kThreads) kda_state_grads_kernel(GatedDeltaArgs p) {
  using L = StateGradsLayout<D>;
  static_assert(kThreads % D == 0, "a thread keeps one key dimension");
  constexpr int kPerThread = kC * D / kThreads;
  constexpr int kBatch = 8;
  static_assert(kPerThread % kBatch == 0, "whole batches");
  extern __shared__ __align__(128) unsigned char raw[];
  T* do_s = reinterpret_cast<T*>(raw + L::d_out);
  T* u_s = reinterpret_cast<T*>(raw + L::u);
  T* du_s = reinterpret_cast<T*>(raw + L::du);
  T* st_s = reinterpret_cast<T*>(raw + L::st);
  T* ds_s = reinterpret_cast<T*>(raw + L::ds);
  float* res = reinterpret_cast<float*>(raw + L::result);
  float* col = reinterpret_cast<float*>(raw + L::col);
  float* row_dot = reinterpret_cast<float*>(raw + L::row_dot);
  const ChunkPosition at(p, blockIdx.y, blockIdx.x);
  load_rows<T, D, kThreads>(
      do_s, Ld<D>::e,
      [&](int r) { return static_cast<const T*>(p.d_out) + at.token(r, D, p.heads, p.tokens); },
      at.valid);
  load_matrix<T, kC, D, kThreads>(u_s, Ld<D>::e, static_cast<const T*>(p.u) + at.tile(0, D), D);
  load_matrix<T, kC, D, kThreads>(du_s, Ld<D>::e, static_cast<const T*>(p.du) + at.tile(0, D), D);
  load_matrix<T, D, D, kThreads>(st_s, Ld<D>::e, static_cast<const T*>(p.states) + at.state(D), D);
  load_matrix<T, D, D, kThreads>(ds_s, Ld<D>::e, static_cast<const T*>(p.state_grads) + at.state(D),
                                 D);
  if (threadIdx.x < D) col[threadIdx.x] = 0.f;
  finish_loads();
  __syncthreads();
  const int d = threadIdx.x % D;  // this thread's key dimension in every phase
  const float* gsum = p.gate_sums + at.tile(0, D);
  const float g_end = gsum[(kC - 1) * D + d];
  const T* q = static_cast<const T*>(p.q);
  const T* k = static_cast<const T*>(p.k);
  float dg[kPerThread];
  // dq = dq_partial + exp(G) . (scale dO S^T); dG = Q . that.
  gemm<T, kWarps, false, true>(do_s, Ld<D>::e, st_s, Ld<D>::e, res, Ld<D>::f, kC, D, D, false);
  if (threadIdx.x < D) {  // rowsum(S . dS) of state row d (from the element-type copies)
    float sum = 0.f;
    for (int c = 0; c < D; ++c) {
      sum +=
          to_float(st_s[threadIdx.x * Ld<D>::e + c]) * to_float(ds_s[threadIdx.x * Ld<D>::e + c]);
    }
    row_dot[threadIdx.x] = sum;
  }
  __syncthreads();
  T* dq_out = static_cast<T*>(p.dq);
  const float* dq_partial = p.dq_partial + at.tile(0, D);
  // Each loop below reads its global operands for kBatch elements before it stores any: with
  // stores in between, the compiler must keep every load behind them (the pointers may alias),
  // and one CTA per SM cannot hide that chain of memory latencies.
#pragma unroll
  for (int i0 = 0; i0 < kPerThread; i0 += kBatch) {
    float gate[kBatch], partial[kBatch], qv[kBatch];
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int e = threadIdx.x + (i0 + j) * kThreads, t = e / D;
      gate[j] = gsum[e];
      partial[j] = dq_partial[e];
      qv[j] = t < at.valid ? to_float(q[at.token(t, D, p.heads, p.tokens) + d]) : 0.f;
    }
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int e = threadIdx.x + (i0 + j) * kThreads, t = e / D;
      const float through_state = p.scale * res[t * Ld<D>::f + d] * __expf(gate[j]);
      dg[i0 + j] = qv[j] * through_state;
      if (t < at.valid) {
        dq_out[at.token(t, D, p.heads, p.tokens) + d] = from_float<T>(partial[j] + through_state);
      }
    }
  }
  __syncthreads();
  // dk' += exp(G_C - G) . (u dS^T); dG -= K . that; the last row collects their sum.
  gemm<T, kWarps, false, true>(u_s, Ld<D>::e, ds_s, Ld<D>::e, res, Ld<D>::f, kC, D, D, false);
  __syncthreads();
  float* dk_partial = p.dk_partial + at.tile(0, D);
  float k_terms = 0.f;
#pragma unroll
  for (int i0 = 0; i0 < kPerThread; i0 += kBatch) {
    float gate[kBatch], partial[kBatch], kv[kBatch];
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int e = threadIdx.x + (i0 + j) * kThreads, t = e / D;
      gate[j] = gsum[e];
      partial[j] = dk_partial[e];
      kv[j] = t < at.valid ? to_float(k[at.token(t, D, p.heads, p.tokens) + d]) : 0.f;
    }
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int e = threadIdx.x + (i0 + j) * kThreads, t = e / D;
      const float dk_end = res[t * Ld<D>::f + d] * __expf(g_end - gate[j]);
      dk_partial[e] = partial[j] + dk_end;
      const float term = kv[j] * dk_end;
      dg[i0 + j] -= term;
      k_terms += term;
    }
  }
  atomicAdd(&col[d], k_terms);
  __syncthreads();
  // dW = -du S^T.
  gemm<T, kWarps, false, true>(du_s, Ld<D>::e, st_s, Ld<D>::e, res, Ld<D>::f, kC, D, D, false);
  __syncthreads();
  T* dw = static_cast<T*>(p.dw) + at.tile(0, D);  // a product operand of the WY backward
  float* dgate = p.dgate_partial + at.tile(0, D);
#pragma unroll
  for (int i0 = 0; i0 < kPerThread; i0 += kBatch) {
    float partial[kBatch];
#pragma unroll
    for (int j = 0; j < kBatch; ++j) partial[j] = dgate[threadIdx.x + (i0 + j) * kThreads];
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int e = threadIdx.x + (i0 + j) * kThreads, t = e / D;
      dw[e] = from_float<T>(-res[t * Ld<D>::f + d]);
      float x = partial[j] + dg[i0 + j];
      if (t == kC - 1) x += col[d] + __expf(g_end) * row_dot[d];
      dgate[e] = x;
    }
  }
}

template <typename T, int D>
struct KdaStateGrads {
  static cudaError_t launch(const GatedDeltaArgs& a, cudaStream_t stream) {
    return launch_pass(kda_state_grads_kernel<T, D>, chunk_grid(a), kThreads,
                       StateGradsLayout<D>::bytes, a, stream);
  }
};

}  // namespace

cudaError_t run_kda_state_grads(const GatedDeltaArgs& a, cudaStream_t stream) {
  return dispatch<KdaStateGrads>(a, stream);
}

}  // namespace gated_delta
}  // namespace mhla_kernels
