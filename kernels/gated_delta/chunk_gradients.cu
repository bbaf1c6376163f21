// Per-chunk gradients of the fused gated DeltaNet, in one pass after the states' backward pass.
// One CTA per (chunk, batch x head), products on tensor cores. With dO' = scale dO,
// P = (Q K^T) . D, the chunk's u and du (the total gradient of u), S_i and the gradient dS_{i+1}
// of the state leaving the chunk:
//   chunk part:  dP^ = dO' u^T;  M = dP^ . D  (the gradient of the raw scores Q K^T)
//                dq  = exp(G) . (dO' S_i^T) + M K
//                dk' = M^T Q + exp(G_C - G) . (u dS_{i+1}^T)
//                dW  = -du S_i^T
//                dG' = rowsum(dP^ . P) - colsum(dP^ . P) + exp(G) . rowsum(Q . (dO' S_i^T))
//                      - exp(G_C - G) . rowsum(K . (u dS^T)), and at r = C - 1 (G_C) also
//                      sum(exp(G_C - G) . rowsum(K . (u dS^T))) + exp(G_C) sum(S_i . dS_{i+1});
//   WY part (the backward of [W | U0] = (I + A)^-1 X, X = [diag(beta exp(G)) K | diag(beta) V],
//   T = (I + A)^-1 from the prepare pass, E_rs = exp(G_r - G_s), N = dA . beta_r E):
//                dX = T^T [dW | du],  dA = -dX [W | U0]^T (strictly lower)
//                dk = dk' + diag(beta exp(G)) dX_K + N K + N^T K,   dv = diag(beta) dX_V
//                dbeta_r = exp(G_r) k_r . dX_K[r] + v_r . dX_V[r] + sum_s dA_rs (k_r . k_s) E_rs
//                dG_r   += beta_r exp(G_r) k_r . dX_K[r] + sum_s dA_rs A_rs - sum_s dA_sr A_sr
//   and dg is the reverse running sum of dG inside the chunk (g_t enters every G_r, r >= t).
// dk', dW and dG' stay in shared memory between the parts (no fp32 round trip through global
// memory); the WY part's tiles take the places the chunk part has finished with, and W, U0 and
// T stream in while the chunk part still runs.
#include <type_traits>

#include "gated_delta/chunk_passes.h"
#include "gated_delta/chunk_tiles.cuh"

namespace mhla_kernels {
namespace gated_delta {
namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;

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

// Shared memory. Both parts: dk' (fp32, the WY products accumulate into it), the per-row
// values, K and du. The chunk part's tiles are ordered so that those it finishes with first make
// room for the WY part's (D = 128: W | U0 over the scores and dO, K K^T over u, dW and then dX_K
// over dS, T and dW over Q and M, dX_V over S_i); at D = 64 the WY part simply follows.
template <int D>
struct GradsLayout {
  static constexpr int ld_wide_e = 2 * D + 8;              // [W | U0] rows, element type
  static constexpr size_t tile_e = 2 * kC * Ld<D>::e;      // [64][D + 8] element type
  static constexpr size_t tile_f = 4 * kC * Ld<D>::f;      // [64][D + 4] fp32
  static constexpr size_t square_f = 4 * kC * kLdSquare;   // [64][68] fp32
  static constexpr size_t square_e = 2 * kC * kLdSquareE;  // [64][72] element type
  static constexpr size_t state_e = 2 * D * Ld<D>::e;      // [D][D + 8] element type
  static constexpr int kRowValues = 10;                    // per-row arrays of 64 floats, + 32
  // Both parts.
  static constexpr size_t dk = 0;
  static constexpr size_t rows = dk + tile_f;
  static constexpr size_t k = rows + 4 * (kRowValues * kC + 32);
  static constexpr size_t du = k + tile_e;
  // Chunk part.
  static constexpr size_t scores = du + tile_e;  // fp32 [64][68]
  static constexpr size_t d_out = scores + square_f;
  static constexpr size_t u = d_out + tile_e;
  static constexpr size_t ds = u + tile_e;
  static constexpr size_t q = ds + state_e;
  static constexpr size_t m = q + tile_e;
  static constexpr size_t st = m + square_e;
  static constexpr size_t chunk_end = st + state_e;
  // WY part.
  static constexpr bool overlay = D == 128;
  static constexpr size_t sol = overlay ? scores : chunk_end;           // [64][2D + 8]
  static constexpr size_t kk = overlay ? u : sol + 2 * kC * ld_wide_e;  // fp32 [64][68]
  static constexpr size_t dw_f = overlay ? ds : kk + square_f;          // fp32 [64][D + 4]
  static constexpr size_t dxk_f = dw_f;                                 // then dX_K, then dA
  static constexpr size_t t = overlay ? q : dw_f + tile_f;              // [64][72]
  static constexpr size_t dw_e = t + square_e;                          // [64][D + 8], then dX_K
  static constexpr size_t dxv_f = overlay ? st : dw_e + tile_e;         // fp32 [64][D + 4], then N
  static constexpr size_t bytes = overlay ? chunk_end : dxv_f + tile_f;
  static_assert(!overlay || (2 * kC * ld_wide_e <= square_f + tile_e &&  // W | U0: scores, dO
                             square_f <= tile_e &&                       // K K^T: u
                             tile_f <= state_e &&                        // dW, dX_K: dS
                             square_e + tile_e <= tile_e + square_e &&   // T, dW: Q, M
                             tile_f <= state_e),                         // dX_V: S_i
                "the WY tiles fit where the chunk part's were");
  static_assert(square_f <= tile_f && square_e <= tile_f, "dA and N fit dX's tiles");
};

template <typename T, int D>
__global__ void __launch_bounds__(kThreads) chunk_grads_kernel(GatedDeltaArgs p) {
  using L = GradsLayout<D>;
  constexpr int kRowsPerWarp = kC / kWarps;
  constexpr int kPerLane = D / 32;
  extern __shared__ __align__(128) unsigned char raw[];
  float* dk_f = reinterpret_cast<float*>(raw + L::dk);  // dP^, then Y, Z, then dk' and dk
  float* g = reinterpret_cast<float*>(raw + L::rows);   // [64]
  float* decay = g + kC;                                // [64]: scale exp(G_r)
  float* to_end = decay + kC;                           // [64]: exp(G_C - G_r)
  float* dg = to_end + kC;                              // [64]: the chunk part's dG'
  float* col = dg + kC;                                 // [64]: column sums, then K~ terms
  float* beta = col + kC;                               // [64]
  float* gate = beta + kC;                              // [64]: exp(G_r)
  float* dg_wy = gate + kC;                             // [64]: the WY part's dG
  float* dbeta = dg_wy + kC;                            // [64]
  float* col_wy = dbeta + kC;                           // [64]: sum_r dA_rs A_rs
  float* scratch = col_wy + kC;                         // [32]
  T* k_s = reinterpret_cast<T*>(raw + L::k);
  T* du_s = reinterpret_cast<T*>(raw + L::du);
  float* pf = reinterpret_cast<float*>(raw + L::scores);  // scores, then dP^ . P
  T* do_s = reinterpret_cast<T*>(raw + L::d_out);         // dO (unscaled)
  T* u_s = reinterpret_cast<T*>(raw + L::u);
  T* ds_s = reinterpret_cast<T*>(raw + L::ds);  // [D][D + 8]: dS_{i+1}
  T* q_s = reinterpret_cast<T*>(raw + L::q);
  T* m_bf = reinterpret_cast<T*>(raw + L::m);   // [64][72]
  T* st_s = reinterpret_cast<T*>(raw + L::st);  // [D][D + 8]: S_i
  const ChunkPosition at = block_chunk(p);
  load_token_rows<T, D, kThreads>(q_s, Ld<D>::e, p.q, p, at);
  load_token_rows<T, D, kThreads>(k_s, Ld<D>::e, p.k, p, at);
  load_token_rows<T, D, kThreads>(do_s, Ld<D>::e, p.d_out, p, at);  // dO; dO' = scale dO
  load_matrix<T, kC, D, kThreads>(u_s, Ld<D>::e, static_cast<const T*>(p.u) + at.tile(0, D), D);
  load_matrix<T, kC, D, kThreads>(du_s, Ld<D>::e, static_cast<const T*>(p.du) + at.tile(0, D), D);
  load_matrix<T, D, D, kThreads>(st_s, Ld<D>::e, static_cast<const T*>(p.states) + at.state(D), D);
  load_matrix<T, D, D, kThreads>(ds_s, Ld<D>::e, static_cast<const T*>(p.state_grads) + at.state(D),
                                 D);
  load_gate_sums(g, p, at);
  if (threadIdx.x < kC) {
    const int r = threadIdx.x;
    beta[r] = r < at.valid ? p.beta[at.token(r, 1, p.heads, p.tokens)] : 0.f;
  }
  finish_loads();
  __syncthreads();

  // ---- Chunk part.
  if (threadIdx.x < kC) {
    const float e = __expf(g[threadIdx.x]);
    gate[threadIdx.x] = e;
    decay[threadIdx.x] = p.scale * e;
    to_end[threadIdx.x] = __expf(g[kC - 1] - g[threadIdx.x]);
  }
  gemm<T, kWarps, false, true, kWarps / 4>(q_s, Ld<D>::e, k_s, Ld<D>::e, pf, kLdSquare, kC, kC, D,
                                           false);
  gemm<T, kWarps, false, true, kWarps / 4>(do_s, Ld<D>::e, u_s, Ld<D>::e, dk_f, kLdSquare, kC, kC,
                                           D, false);
  __syncthreads();
  for (int e = threadIdx.x; e < kC * kC / 8; e += kThreads) {  // 8 columns per thread
    const int r = e / (kC / 8), s0 = 8 * (e % (kC / 8));
    float mv[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int s = s0 + j;
      float t = 0.f;
      mv[j] = 0.f;
      if (s <= r) {
        const float d = __expf(g[r] - g[s]), dp = p.scale * dk_f[r * kLdSquare + s];
        t = dp * pf[r * kLdSquare + s] * d;
        mv[j] = dp * d;
      }
      pf[r * kLdSquare + s] = t;
    }
    store_pack<T, 8>(m_bf + r * kLdSquareE + s0, mv);
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
  gemm<T, kWarps, false, true, kWarps / 4>(do_s, Ld<D>::e, st_s, Ld<D>::e, dk_f, Ld<D>::f, kC, D, D,
                                           false);
  __syncthreads();
  // The scores and dO are done with: W | U0 stream in over them (D = 128) while the rest runs.
  T* sol = reinterpret_cast<T*>(raw + L::sol);
  load_matrix<T, kC, D, kThreads>(sol, L::ld_wide_e, static_cast<const T*>(p.w) + at.tile(0, D), D);
  load_matrix<T, kC, D, kThreads>(sol + D, L::ld_wide_e,
                                  static_cast<const T*>(p.u0) + at.tile(0, D), D);
  copy_async_commit();
  row_dot_then_scale<T, D>(q_s, dk_f, decay,
                           [&](int r, float sum) { dg[r] += decay[r] * sum - col[r]; });
  __syncthreads();
  gemm<T, kWarps, false, false, kWarps / 4>(m_bf, kLdSquareE, k_s, Ld<D>::e, dk_f, Ld<D>::f, kC, D,
                                            kC, true);
  __syncthreads();
  T* dq = static_cast<T*>(p.dq);
  store_rows<T, D, kThreads>([&](int r) { return dq + at.token(r, D, p.heads, p.tokens); }, dk_f,
                             Ld<D>::f, at.valid);
  __syncthreads();
  // Z = u dS_{i+1}^T, the gradient of K~.
  gemm<T, kWarps, false, true, kWarps / 4>(u_s, Ld<D>::e, ds_s, Ld<D>::e, dk_f, Ld<D>::f, kC, D, D,
                                           false);
  float state_dot = 0.f;  // sum(S_i . dS_{i+1}), before dS's tile is reused
  for (int e = threadIdx.x; e < D * D; e += kThreads) {
    const int r = e / D, c = e % D;
    state_dot += to_float(st_s[r * Ld<D>::e + c]) * to_float(ds_s[r * Ld<D>::e + c]);
  }
  state_dot = block_sum<kThreads>(state_dot, scratch);  // synchronizes
  row_dot_then_scale<T, D>(k_s, dk_f, to_end, [&](int r, float sum) {
    const float t = to_end[r] * sum;
    dg[r] -= t;
    col[r] = t;
  });
  // K K^T for the WY part, over u (done with since Z).
  float* kk = reinterpret_cast<float*>(raw + L::kk);
  gemm<T, kWarps, false, true, kWarps / 4>(k_s, Ld<D>::e, k_s, Ld<D>::e, kk, kLdSquare, kC, kC, D,
                                           false);
  __syncthreads();
  // dk' = Z . exp(G_C - G) + M^T Q, kept in dk_f.
  gemm<T, kWarps, true, false, kWarps / 4>(m_bf, kLdSquareE, q_s, Ld<D>::e, dk_f, Ld<D>::f, kC, D,
                                           kC, true);
  __syncthreads();
  // Q and M are done with: T streams in over them.
  T* t_s = reinterpret_cast<T*>(raw + L::t);
  load_matrix<T, kC, kC, kThreads>(t_s, kLdSquareE,
                                   static_cast<const T*>(p.t_inverse) + at.tile(0, kC), kC);
  copy_async_commit();
  // dW = -du S_i^T: fp32 over dS, then the element type beside T.
  float* dw_f = reinterpret_cast<float*>(raw + L::dw_f);
  T* dw_e = reinterpret_cast<T*>(raw + L::dw_e);
  gemm<T, kWarps, false, true, kWarps / 4>(du_s, Ld<D>::e, st_s, Ld<D>::e, dw_f, Ld<D>::f, kC, D, D,
                                           false);
  if (threadIdx.x == 0) {
    float k_terms = 0.f;
    for (int r = 0; r < kC; ++r) k_terms += col[r];
    dg[kC - 1] += k_terms + __expf(g[kC - 1]) * state_dot;
  }
  __syncthreads();
  store_rows<T, D, kThreads>([&](int r) { return dw_e + r * Ld<D>::e; }, dw_f, Ld<D>::f, kC, -1.f);
  copy_async_wait<0>();
  __syncthreads();

  // ---- WY part. dX = T^T [dW | du], its halves over dW's fp32 tile and over S_i.
  float* dxk_f = reinterpret_cast<float*>(raw + L::dxk_f);
  float* dxv_f = reinterpret_cast<float*>(raw + L::dxv_f);
  gemm<T, kWarps, true, false, kWarps / 4>(t_s, kLdSquareE, dw_e, Ld<D>::e, dxk_f, Ld<D>::f, kC, D,
                                           kC, false);
  gemm<T, kWarps, true, false, kWarps / 4>(t_s, kLdSquareE, du_s, Ld<D>::e, dxv_f, Ld<D>::f, kC, D,
                                           kC, false);
  __syncthreads();
  T* dxk_e = dw_e;  // dX in the element type, over dW and du (both done with)
  T* dxv_e = du_s;
  {
    // A warp's rows: dk' + diag(beta exp(G)) dX_K, dv, the row sums for dbeta and dG, and dX in
    // the element type. The global rows of v are read before any sum needs them.
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const T* v = static_cast<const T*>(p.v);
    float v_rows[kRowsPerWarp][kPerLane];
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i) {
      const int r = warp + kWarps * i;
      const bool in = r < at.valid;
      const int64_t row = at.token(in ? r : 0, D, p.heads, p.tokens);
#pragma unroll
      for (int j = 0; j < kPerLane; ++j) v_rows[i][j] = in ? to_float(v[row + lane + 32 * j]) : 0.f;
    }
    T* dv = static_cast<T*>(p.dv);
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i) {
      const int r = warp + kWarps * i;
      const bool in = r < at.valid;
      const int64_t row = at.token(in ? r : 0, D, p.heads, p.tokens);
      const float xk = beta[r] * gate[r];
      float sk = 0.f, sv = 0.f;
#pragma unroll
      for (int j = 0; j < kPerLane; ++j) {
        const int c = lane + 32 * j;
        const float dxk = dxk_f[r * Ld<D>::f + c], dxv = dxv_f[r * Ld<D>::f + c];
        sk += to_float(k_s[r * Ld<D>::e + c]) * dxk;
        sv += v_rows[i][j] * dxv;
        if (in) dv[row + c] = from_float<T>(beta[r] * dxv);
        dk_f[r * Ld<D>::f + c] += xk * dxk;
        dxk_e[r * Ld<D>::e + c] = from_float<T>(dxk);
        dxv_e[r * Ld<D>::e + c] = from_float<T>(dxv);
      }
      sk = warp_sum(sk);
      sv = warp_sum(sv);
      if (lane == 0) {
        dbeta[r] = gate[r] * sk + sv;
        dg_wy[r] = xk * sk;
      }
    }
  }
  __syncthreads();
  // dA = -dX [W | U0]^T, over dX_K's fp32 tile (done with).
  float* da = dxk_f;
  gemm<T, kWarps, false, true, kWarps / 4>(dxk_e, Ld<D>::e, sol, L::ld_wide_e, da, kLdSquare, kC,
                                           kC, D, false);
  gemm<T, kWarps, false, true, kWarps / 4>(dxv_e, Ld<D>::e, sol + D, L::ld_wide_e, da, kLdSquare,
                                           kC, kC, D, true);
  __syncthreads();
  T* n_bf = reinterpret_cast<T*>(raw + L::dxv_f);  // N, over dX_V's fp32 tile (done with)
  {
    // N and the row sums of dA . A, a warp per row (lanes over two columns each); then the
    // column sums, a warp per column.
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (int r = warp; r < kC; r += kWarps) {
      float db = 0.f;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int s = lane + 32 * h;
        float n = 0.f;
        if (s < r) {
          const float d_a = -da[r * kLdSquare + s], e = __expf(g[r] - g[s]);
          db += d_a * kk[r * kLdSquare + s] * e;
          n = d_a * beta[r] * e;
        }
        n_bf[r * kLdSquareE + s] = from_float<T>(n);
      }
      db = warp_sum(db);
      if (lane == 0) {
        dbeta[r] += db;
        dg_wy[r] += beta[r] * db;
      }
    }
    for (int s = warp; s < kC; s += kWarps) {
      float sum = 0.f;  // sum_r dA_rs A_rs
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = lane + 32 * h;
        if (r > s) {
          sum -= da[r * kLdSquare + s] * beta[r] * kk[r * kLdSquare + s] * __expf(g[r] - g[s]);
        }
      }
      sum = warp_sum(sum);
      if (lane == 0) col_wy[s] = sum;
    }
  }
  __syncthreads();
  gemm<T, kWarps, false, false, kWarps / 4>(n_bf, kLdSquareE, k_s, Ld<D>::e, dk_f, Ld<D>::f, kC, D,
                                            kC, true);
  __syncthreads();
  gemm<T, kWarps, true, false, kWarps / 4>(n_bf, kLdSquareE, k_s, Ld<D>::e, dk_f, Ld<D>::f, kC, D,
                                           kC, true);
  __syncthreads();
  T* dk = static_cast<T*>(p.dk);
  store_rows<T, D, kThreads>([&](int r) { return dk + at.token(r, D, p.heads, p.tokens); }, dk_f,
                             Ld<D>::f, at.valid);
  if (threadIdx.x < kC) {
    const int r = threadIdx.x;
    dg_wy[r] += dg[r] - col_wy[r];
    if (r < at.valid) p.dbeta[at.token(r, 1, p.heads, p.tokens)] = dbeta[r];
  }
  __syncthreads();
  if (threadIdx.x < 32) {
    warp_reverse_running_sum64(dg_wy);
    __syncwarp();
    for (int r = threadIdx.x; r < at.valid; r += 32) {
      p.dgate[at.token(r, 1, p.heads, p.tokens)] = dg_wy[r];
    }
  }
}

template <typename T, int D>
struct ChunkGrads {
  static cudaError_t launch(const GatedDeltaArgs& a, cudaStream_t stream) {
    return launch_pass(chunk_grads_kernel<T, D>, chunk_grid(a), kThreads, GradsLayout<D>::bytes, a,
                       stream);
  }
};

}  // namespace

cudaError_t run_chunk_grads(const GatedDeltaArgs& a, cudaStream_t stream) {
  return dispatch<ChunkGrads>(a, stream);
}

}  // namespace gated_delta
}  // namespace mhla_kernels
