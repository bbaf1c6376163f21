// KDA backward, the per-chunk gradients of q, k and the gate sums that flow through the chunk's
// scores P and its states (o = scale [(exp(G) . Q) S_i + P u], P_ts = sum_d q_td k_sd
// exp(G_td - G_sd) for s <= t), with du the total gradient of u and dS_{i+1} the gradient of the
// state leaving the chunk (both from the states' backward pass):
//   through P:     dP = scale dO u^T (lower); per_key_scores_backward gives R = dL/dq and
//                  C = dL/dk through P, and dG = Q . R - K . C;
//   through S_i:   dq = R + exp(G) . (scale dO S_i^T)                         (final)
//                  dk' = C + exp(G_C - G) . (u dS_{i+1}^T)                    (the WY passes add)
//                  dW = -du S_i^T
//                  dG += Q . exp(G) . (scale dO S_i^T) - K . exp(G_C - G) . (u dS^T), and on the
//                  last row G_C also sum_t K . exp(G_C - G) . (u dS^T) + exp(G_C) . rowsum(S_i .
//                  dS_{i+1}).
// One CTA per (chunk, batch x head). The first part keeps its shared-memory tiles; R, C and G
// then move into registers (each thread keeps the same (row, key dimension) elements to the
// end) and the second part's tiles take their place. One pass instead of two saves the round
// trip of dq, dk' and dG' through fp32 global buffers and a second load of q, k, dO and u.
#include "gated_delta/chunk_passes.h"
#include "gated_delta/chunk_tiles.cuh"
#include "gated_delta/per_key_scores.cuh"

namespace mhla_kernels {
namespace gated_delta {
namespace {

constexpr int kThreads = 1024;  // 32 warps: the elementwise phases are latency-bound
constexpr int kWarps = kThreads / 32;

template <int D>
struct ChunkGradsLayout {
  // Both parts.
  static constexpr size_t q = 0;                          // [64][D + 8]
  static constexpr size_t k = q + 2 * kC * Ld<D>::e;      // [64][D + 8]
  static constexpr size_t d_out = k + 2 * kC * Ld<D>::e;  // [64][D + 8]: dO (unscaled)
  static constexpr size_t u = d_out + 2 * kC * Ld<D>::e;  // [64][D + 8]
  // First part (through P).
  static constexpr size_t g = u + 2 * kC * Ld<D>::e;          // f32 [64][D + 4]: G
  static constexpr size_t r = g + 4 * kC * Ld<D>::f;          // f32 [64][D + 4]: R
  static constexpr size_t c = r + 4 * kC * Ld<D>::f;          // f32 [64][D + 4]: C
  static constexpr size_t m = c + 4 * kC * Ld<D>::f;          // [64][72]: dP
  static constexpr size_t scratch = m + 2 * kC * kLdSquareE;  // f32 [64][68] dP, then scaled rows
  static constexpr size_t scratch_bytes = 2 * kScoresBackwardScratchRows * Ld<D>::e;
  static_assert(4 * kC * kLdSquare <= scratch_bytes, "dP fits the scratch");
  static constexpr size_t bytes = scratch + scratch_bytes;
  // Second part (through the states): du and S_i where dP and the scratch were (loaded while
  // R, C and G move to registers), dS_{i+1}, the products and the sums where G, R and C were.
  static constexpr size_t du = m;                          // [64][D + 8]
  static constexpr size_t st = du + 2 * kC * Ld<D>::e;     // [D][D + 8]: S_i
  static constexpr size_t ds = g;                          // [D][D + 8]: dS_{i+1}
  static constexpr size_t result = ds + 2 * D * Ld<D>::e;  // f32 [64][D + 4]
  // f32 [kThreads / D][D]: each row group's part of the last row's column sums, added in a
  // fixed order (an atomic sum would make dg differ from run to run).
  static constexpr size_t col = result + 4 * kC * Ld<D>::f;
  static constexpr size_t row_dot = col + 4 * kThreads;  // f32 [D]
  static_assert(st + 2 * D * Ld<D>::e <= bytes, "du and S_i fit the first part's tiles");
  static_assert(row_dot + 4 * D <= m, "dS, the products and the sums fit G, R and C");
};

template <typename T, int D>
__global__ void __launch_bounds__(kThreads) kda_chunk_grads_kernel(GatedDeltaArgs p) {
  using L = ChunkGradsLayout<D>;
  constexpr int ldg = Ld<D>::f;
  static_assert(kThreads % D == 0, "a thread keeps one key dimension");
  constexpr int kRowsPerPass = kThreads / D;
  constexpr int kPerThread = kC / kRowsPerPass;  // (row, d) elements a thread keeps
  extern __shared__ __align__(128) unsigned char raw[];
  T* q_s = reinterpret_cast<T*>(raw + L::q);
  T* k_s = reinterpret_cast<T*>(raw + L::k);
  T* do_s = reinterpret_cast<T*>(raw + L::d_out);
  T* u_s = reinterpret_cast<T*>(raw + L::u);
  float* g = reinterpret_cast<float*>(raw + L::g);
  float* r_f = reinterpret_cast<float*>(raw + L::r);
  float* c_f = reinterpret_cast<float*>(raw + L::c);
  T* m_bf = reinterpret_cast<T*>(raw + L::m);
  T* scratch = reinterpret_cast<T*>(raw + L::scratch);
  float* dp = reinterpret_cast<float*>(raw + L::scratch);
  const ChunkPosition at = block_chunk(p);
  load_token_rows<T, D, kThreads>(q_s, Ld<D>::e, p.q, p, at);
  load_token_rows<T, D, kThreads>(k_s, Ld<D>::e, p.k, p, at);
  load_token_rows<T, D, kThreads>(do_s, Ld<D>::e, p.d_out, p, at);
  load_matrix<T, kC, D, kThreads>(u_s, Ld<D>::e, static_cast<const T*>(p.u) + at.tile(0, D), D);
  load_matrix<float, kC, D, kThreads>(g, ldg, p.gate_sums + at.tile(0, D), D);
  finish_loads();
  __syncthreads();

  // ---- Through P: R, C and the gate sums' part Q . R - K . C.
  gemm<T, kWarps, false, true, kWarps / 2>(do_s, Ld<D>::e, u_s, Ld<D>::e, dp, kLdSquare, kC, kC, D,
                                           false);
  for (int e = threadIdx.x; e < kC * (D / 4); e += kThreads) {
    const int t = e / (D / 4), d = 4 * (e % (D / 4));
    *reinterpret_cast<float4*>(r_f + t * ldg + d) = float4{};
    *reinterpret_cast<float4*>(c_f + t * ldg + d) = float4{};
  }
  __syncthreads();
  for (int e = threadIdx.x; e < kC * kC / 8; e += kThreads) {
    const int t = e / (kC / 8), s0 = 8 * (e % (kC / 8));
    float x[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) x[j] = s0 + j <= t ? p.scale * dp[t * kLdSquare + s0 + j] : 0.f;
    store_pack<T, 8>(m_bf + t * kLdSquareE + s0, x);
  }
  __syncthreads();
  per_key_scores_backward<T, D, kThreads>(m_bf, q_s, k_s, g, scratch, r_f, c_f);  // ends synced

  // du and S_i stream in over dP and the scratch while this thread's R, C, G move to registers.
  T* du_s = reinterpret_cast<T*>(raw + L::du);
  T* st_s = reinterpret_cast<T*>(raw + L::st);
  load_matrix<T, kC, D, kThreads>(du_s, Ld<D>::e, static_cast<const T*>(p.du) + at.tile(0, D), D);
  load_matrix<T, D, D, kThreads>(st_s, Ld<D>::e, static_cast<const T*>(p.states) + at.state(D), D);
  copy_async_commit();
  const int d = threadIdx.x % D, row0 = threadIdx.x / D;  // rows row0 + kRowsPerPass * i
  float rq[kPerThread], ck[kPerThread], gate[kPerThread], dg[kPerThread];
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    const int t = row0 + kRowsPerPass * i;
    rq[i] = r_f[t * ldg + d];
    ck[i] = c_f[t * ldg + d];
    gate[i] = g[t * ldg + d];
    dg[i] = to_float(q_s[t * Ld<D>::e + d]) * rq[i] - to_float(k_s[t * Ld<D>::e + d]) * ck[i];
  }
  const float g_end = g[(kC - 1) * ldg + d];
  __syncthreads();  // G, R and C are read: dS_{i+1} may overwrite them

  // ---- Through the states.
  T* ds_s = reinterpret_cast<T*>(raw + L::ds);
  float* res = reinterpret_cast<float*>(raw + L::result);
  float* col = reinterpret_cast<float*>(raw + L::col);
  float* row_dot = reinterpret_cast<float*>(raw + L::row_dot);
  load_matrix<T, D, D, kThreads>(ds_s, Ld<D>::e, static_cast<const T*>(p.state_grads) + at.state(D),
                                 D);
  copy_async_commit();
  copy_async_wait<1>();  // du and S_i (dS_{i+1} may still be in flight)
  __syncthreads();
  // dq = R + exp(G) . (scale dO S^T); dG += Q . that.
  gemm<T, kWarps, false, true, kWarps / 2>(do_s, Ld<D>::e, st_s, Ld<D>::e, res, ldg, kC, D, D,
                                           false);
  copy_async_wait<0>();
  __syncthreads();
  {  // rowsum(S . dS) of each state row (from the element-type copies), four rows per warp
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (int row = warp; row < D; row += kWarps) {
      float sum = 0.f;
      for (int c = lane; c < D; c += 32) {
        sum += to_float(st_s[row * Ld<D>::e + c]) * to_float(ds_s[row * Ld<D>::e + c]);
      }
      sum = warp_sum(sum);
      if (lane == 0) row_dot[row] = sum;
    }
  }
  T* dq_out = static_cast<T*>(p.dq);
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    const int t = row0 + kRowsPerPass * i;
    const float through_state = p.scale * res[t * ldg + d] * __expf(gate[i]);
    dg[i] += to_float(q_s[t * Ld<D>::e + d]) * through_state;
    if (t < at.valid) {
      dq_out[at.token(t, D, p.heads, p.tokens) + d] = from_float<T>(rq[i] + through_state);
    }
  }
  __syncthreads();
  // dk' = C + exp(G_C - G) . (u dS^T); dG -= K . that; the last row collects their sum.
  gemm<T, kWarps, false, true, kWarps / 2>(u_s, Ld<D>::e, ds_s, Ld<D>::e, res, ldg, kC, D, D,
                                           false);
  __syncthreads();
  float* dk_partial = p.dk_partial + at.tile(0, D);
  float k_terms = 0.f;
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    const int t = row0 + kRowsPerPass * i;
    const float dk_end = res[t * ldg + d] * __expf(g_end - gate[i]);
    dk_partial[t * D + d] = ck[i] + dk_end;
    const float term = to_float(k_s[t * Ld<D>::e + d]) * dk_end;
    dg[i] -= term;
    k_terms += term;
  }
  col[row0 * D + d] = k_terms;
  __syncthreads();
  // dW = -du S^T (the element type: the WY backward's product operand).
  gemm<T, kWarps, false, true, kWarps / 2>(du_s, Ld<D>::e, st_s, Ld<D>::e, res, ldg, kC, D, D,
                                           false);
  __syncthreads();
  T* dw = static_cast<T*>(p.dw) + at.tile(0, D);
  for (int e = threadIdx.x; e < kC * (D / 8); e += kThreads) {
    const int t = e / (D / 8), c = 8 * (e % (D / 8));
    float x[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) x[j] = -res[t * ldg + c + j];
    store_pack<T, 8>(dw + t * D + c, x);
  }
  float* dgate = p.dgate_partial + at.tile(0, D);
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    const int t = row0 + kRowsPerPass * i;
    float x = dg[i];
    if (t == kC - 1) {
      float k_sum = 0.f;
#pragma unroll
      for (int j = 0; j < kRowsPerPass; ++j) k_sum += col[j * D + d];
      x += k_sum + __expf(g_end) * row_dot[d];
    }
    dgate[t * D + d] = x;
  }
}

template <typename T, int D>
struct KdaChunkGrads {
  static cudaError_t launch(const GatedDeltaArgs& a, cudaStream_t stream) {
    return launch_pass(kda_chunk_grads_kernel<T, D>, chunk_grid(a), kThreads,
                       ChunkGradsLayout<D>::bytes, a, stream);
  }
};

}  // namespace

cudaError_t run_kda_chunk_grads(const GatedDeltaArgs& a, cudaStream_t stream) {
  return dispatch<KdaChunkGrads>(a, stream);
}

}  // namespace gated_delta
}  // namespace mhla_kernels
