// KDA backward of the WY system, per chunk, in one pass. With [W | U0] = T X, X = [diag(beta)
// (exp(G) . K) | diag(beta) V], T = (I + A)^-1, A = diag(beta) K~ (K~ the key scores), and the
// gradients dW (kda_chunk_grads.cu) and du (the states' backward pass):
//   system part:  dX = T^T [dW | du];  dA = -dX [W | U0]^T (strictly lower);
//                 dk' += beta exp(G) . dX_K,  dG += K . beta exp(G) . dX_K,  dv = diag(beta) dX_V,
//                 dbeta_r = (exp(G) . k)_r . dX_K[r] + v_r . dX_V[r] + sum_s dA_rs K~_rs,
//                 N = diag(beta) dA (the gradient of K~);
//   key part:     per_key_scores_backward of N with x = y = K gives R and C:
//                 dk = dk' + R + C,  dG += K . (R - C),  dg = the reverse running sum of dG
//                 down each key dimension (g_t enters every G_r with r >= t).
// One CTA per (chunk, batch x head). dk' and dG stay in registers between the parts (each
// thread keeps the same rows and columns) and N in shared memory; the key part's tiles take
// the system part's places.
#include "gated_delta/chunk_passes.h"
#include "gated_delta/chunk_tiles.cuh"
#include "gated_delta/per_key_scores.cuh"

namespace mhla_kernels {
namespace gated_delta {
namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;

template <int D>
struct WyBackwardLayout {
  static constexpr int ld_wide_f = 2 * D + 4;  // fp32 rows of [K | V] columns
  static constexpr int ld_wide_e = 2 * D + 8;  // element-type rows of them
  // Both parts.
  static constexpr size_t k = 0;                          // [64][D + 8]
  static constexpr size_t g = k + 2 * kC * Ld<D>::e;      // f32 [64][D + 4]: G
  static constexpr size_t small = g + 4 * kC * Ld<D>::f;  // f32 [2][64]: beta, dbeta
  static constexpr size_t n = small + 4 * 2 * kC;         // [64][72]: N
  // System part.
  static constexpr size_t dx = n + 2 * kC * kLdSquareE;      // f32 [64][2D + 4]: dX
  static constexpr size_t da = dx;                           // f32 [64][68], after dX
  static constexpr size_t sol = dx + 4 * kC * ld_wide_f;     // [64][2D + 8]: [W | U0]
  static constexpr size_t grads = sol + 2 * kC * ld_wide_e;  // [64][2D + 8]: [dW | du], then dX
  static constexpr size_t t = grads + 2 * kC * ld_wide_e;    // [64][72]: T
  static constexpr size_t kk = t + 2 * kC * kLdSquareE;      // [64][72]: K~
  static constexpr size_t bytes = kk + 2 * kC * kLdSquareE;
  // Key part, over the system part's tiles.
  static constexpr size_t r = dx;                           // f32 [64][D + 4]: R, then dG
  static constexpr size_t c = r + 4 * kC * Ld<D>::f;        // f32 [64][D + 4]: C
  static constexpr size_t scratch = c + 4 * kC * Ld<D>::f;  // scaled rows
  static_assert(scratch + 2 * kScoresBackwardScratchRows * Ld<D>::e <= bytes, "key part fits");
};

template <typename T, int D>
__global__ void __launch_bounds__(kThreads) kda_wy_backward_kernel(GatedDeltaArgs p) {
  using L = WyBackwardLayout<D>;
  constexpr int ldg = Ld<D>::f;
  constexpr int kRowsPerWarp = kC / kWarps;
  constexpr int kPerLane = D / 32;
  extern __shared__ __align__(128) unsigned char raw[];
  T* k_s = reinterpret_cast<T*>(raw + L::k);
  float* g = reinterpret_cast<float*>(raw + L::g);
  float* beta = reinterpret_cast<float*>(raw + L::small);
  float* dbeta = beta + kC;
  T* n_s = reinterpret_cast<T*>(raw + L::n);
  float* dx_f = reinterpret_cast<float*>(raw + L::dx);
  float* da = reinterpret_cast<float*>(raw + L::da);
  T* sol = reinterpret_cast<T*>(raw + L::sol);
  T* grads = reinterpret_cast<T*>(raw + L::grads);
  T* dx_bf = grads;
  T* t_s = reinterpret_cast<T*>(raw + L::t);
  T* kk = reinterpret_cast<T*>(raw + L::kk);
  const ChunkPosition at = block_chunk(p);
  const T* v = static_cast<const T*>(p.v);
  auto tile = [&](const void* base) { return static_cast<const T*>(base) + at.tile(0, D); };
  load_token_rows<T, D, kThreads>(k_s, Ld<D>::e, p.k, p, at);
  load_matrix<float, kC, D, kThreads>(g, ldg, p.gate_sums + at.tile(0, D), D);
  load_matrix<T, kC, D, kThreads>(sol, L::ld_wide_e, tile(p.w), D);
  load_matrix<T, kC, D, kThreads>(sol + D, L::ld_wide_e, tile(p.u0), D);
  load_matrix<T, kC, D, kThreads>(grads, L::ld_wide_e, tile(p.dw), D);
  load_matrix<T, kC, D, kThreads>(grads + D, L::ld_wide_e, tile(p.du), D);
  load_matrix<T, kC, kC, kThreads>(t_s, kLdSquareE,
                                   static_cast<const T*>(p.t_inverse) + at.tile(0, kC), kC);
  load_matrix<T, kC, kC, kThreads>(kk, kLdSquareE,
                                   static_cast<const T*>(p.key_scores) + at.tile(0, kC), kC);
  if (threadIdx.x < kC) {
    const int r = threadIdx.x;
    beta[r] = r < at.valid ? p.beta[at.token(r, 1, p.heads, p.tokens)] : 0.f;
  }
  finish_loads();
  __syncthreads();

  // ---- System part. dX = T^T [dW | du].
  gemm<T, kWarps, true, false, kWarps / 2>(t_s, kLdSquareE, grads, L::ld_wide_e, dx_f, L::ld_wide_f,
                                           kC, 2 * D, kC, false);
  __syncthreads();
  // A warp's rows: dk' and dG from dX_K, dv, dbeta's row sums, and dX in the element type. This
  // thread's dk' and dG (rows warp + kWarps i, columns lane + 32 j) stay in registers.
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float dkp[kRowsPerWarp][kPerLane], dgp[kRowsPerWarp][kPerLane];
  {
    const float* dk_partial = p.dk_partial + at.tile(0, D);
    const float* dgate = p.dgate_partial + at.tile(0, D);
    T* dv = static_cast<T*>(p.dv);
    float vx[kRowsPerWarp][kPerLane];
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i) {  // every global operand in flight at once
      const int r = warp + kWarps * i;
      const bool in = r < at.valid;
      const int64_t row = at.token(in ? r : 0, D, p.heads, p.tokens);
#pragma unroll
      for (int j = 0; j < kPerLane; ++j) {
        const int c = lane + 32 * j;
        vx[i][j] = in ? to_float(v[row + c]) : 0.f;
        dkp[i][j] = dk_partial[r * D + c];
        dgp[i][j] = dgate[r * D + c];
      }
    }
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i) {
      const int r = warp + kWarps * i;
      const bool in = r < at.valid;
      const int64_t row = at.token(in ? r : 0, D, p.heads, p.tokens);
      float sk = 0.f, sv = 0.f;
#pragma unroll
      for (int j = 0; j < kPerLane; ++j) {
        const int c = lane + 32 * j;
        const float gate = __expf(g[r * ldg + c]);
        const float dxk = dx_f[r * L::ld_wide_f + c], dxv = dx_f[r * L::ld_wide_f + D + c];
        const float kx = to_float(k_s[r * Ld<D>::e + c]), through = beta[r] * gate * dxk;
        sk += kx * gate * dxk;
        sv += vx[i][j] * dxv;
        if (in) dv[row + c] = from_float<T>(beta[r] * dxv);
        dkp[i][j] += through;
        dgp[i][j] += kx * through;
        dx_bf[r * L::ld_wide_e + c] = from_float<T>(dxk);
        dx_bf[r * L::ld_wide_e + D + c] = from_float<T>(dxv);
      }
      sk = warp_sum(sk);
      sv = warp_sum(sv);
      if (lane == 0) dbeta[r] = sk + sv;
    }
  }
  __syncthreads();
  // dA = -dX [W | U0]^T (dX's fp32 space is free now).
  gemm<T, kWarps, false, true, kWarps / 2>(dx_bf, L::ld_wide_e, sol, L::ld_wide_e, da, kLdSquare,
                                           kC, kC, 2 * D, false);
  __syncthreads();
  for (int e = threadIdx.x; e < kC * kC / 8; e += kThreads) {  // N = -diag(beta) dA, lower
    const int r = e / (kC / 8), s0 = 8 * (e % (kC / 8));
    float x[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) x[j] = s0 + j < r ? -beta[r] * da[r * kLdSquare + s0 + j] : 0.f;
    store_pack<T, 8>(n_s + r * kLdSquareE + s0, x);
  }
  for (int r = warp; r < kC; r += kWarps) {  // dbeta_r += sum_s dA_rs K~_rs, a warp per row
    float sum = 0.f;
    for (int s = lane; s < r; s += 32)
      sum -= da[r * kLdSquare + s] * to_float(kk[r * kLdSquareE + s]);
    sum = warp_sum(sum);
    if (lane == 0 && r < at.valid) p.dbeta[at.token(r, 1, p.heads, p.tokens)] = dbeta[r] + sum;
  }
  __syncthreads();  // N is published; dA and the system tiles are free

  // ---- Key part: R and C through the key scores.
  float* r_f = reinterpret_cast<float*>(raw + L::r);
  float* c_f = reinterpret_cast<float*>(raw + L::c);
  T* scratch = reinterpret_cast<T*>(raw + L::scratch);
  for (int e = threadIdx.x; e < kC * (D / 4); e += kThreads) {
    const int t = e / (D / 4), d = 4 * (e % (D / 4));
    *reinterpret_cast<float4*>(r_f + t * ldg + d) = float4{};
    *reinterpret_cast<float4*>(c_f + t * ldg + d) = float4{};
  }
  __syncthreads();
  per_key_scores_backward<T, D, kThreads>(n_s, k_s, k_s, g, scratch, r_f, c_f);  // ends synced
  T* dk = static_cast<T*>(p.dk);
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    const int r = warp + kWarps * i;
    const bool in = r < at.valid;
    const int64_t row = at.token(in ? r : 0, D, p.heads, p.tokens);
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int c = lane + 32 * j;
      const float rk = r_f[r * ldg + c], ck = c_f[r * ldg + c];
      if (in) dk[row + c] = from_float<T>(dkp[i][j] + rk + ck);
      r_f[r * ldg + c] = dgp[i][j] + to_float(k_s[r * Ld<D>::e + c]) * (rk - ck);
    }
  }
  __syncthreads();
  // dg: reverse running sums down each key dimension (C's tile is free), written for the valid
  // rows.
  running_sums_down_columns<D, kThreads, /*Reverse=*/true>(r_f, ldg, c_f);
  __syncthreads();
  for (int e = threadIdx.x; e < at.valid * (D / 4); e += kThreads) {
    const int t = e / (D / 4), d = 4 * (e % (D / 4));
    *reinterpret_cast<float4*>(p.dgate + at.token(t, D, p.heads, p.tokens) + d) =
        *reinterpret_cast<const float4*>(r_f + t * ldg + d);
  }
}

template <typename T, int D>
struct KdaWyBackward {
  static cudaError_t launch(const GatedDeltaArgs& a, cudaStream_t stream) {
    return launch_pass(kda_wy_backward_kernel<T, D>, chunk_grid(a), kThreads,
                       WyBackwardLayout<D>::bytes, a, stream);
  }
};

}  // namespace

cudaError_t run_kda_wy_backward(const GatedDeltaArgs& a, cudaStream_t stream) {
  return dispatch<KdaWyBackward>(a, stream);
}

}  // namespace gated_delta
}  // namespace mhla_kernels
