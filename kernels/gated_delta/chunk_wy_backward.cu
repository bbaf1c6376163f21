// The backward of the fused gated DeltaNet's WY system, per chunk: with [W | U0] = (I + A)^-1 X,
// X = [diag(beta exp(G)) K | diag(beta) V] and the gradients dW (chunk_gradients.cu) and du
// (the states' backward pass):
//   dX = T^T [dW | du],  T = (I + A)^-1 from the prepare pass   (tensor cores)
//   dA = -dX [W | U0]^T, strictly lower           (tensor cores)
// then, with E_rs = exp(G_r - G_s) and N = dA . beta_r E (the gradient of K K^T):
//   dk = dk' + diag(beta exp(G)) dX_K + N K + N^T K,   dv = diag(beta) dX_V
//   dbeta_r = exp(G_r) k_r . dX_K[r] + v_r . dX_V[r] + sum_s dA_rs (k_r . k_s) E_rs
//   dG_r   += beta_r exp(G_r) k_r . dX_K[r] + sum_s dA_rs A_rs - sum_s dA_sr A_sr
// and dg is the reverse running sum of dG inside the chunk (g_t enters every G_r with r >= t).
#include "gated_delta/chunk_passes.h"
#include "gated_delta/chunk_tiles.cuh"

namespace mhla_kernels {
namespace gated_delta {
namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;

template <int D>
struct WyLayout {
  static constexpr int ld_wide_f = 2 * D + 4;                // fp32 rows of [K | V] columns
  static constexpr int ld_wide_e = 2 * D + 8;                // element-type rows of them
  static constexpr size_t kk = 0;                            // f32 [64][68]: K K^T
  static constexpr size_t dx = kk + 4 * kC * kLdSquare;      // f32 [64][2D + 4]: dX
  static constexpr size_t da = dx;                           // f32 [64][68], after dX
  static constexpr size_t n = da + 4 * kC * kLdSquare;       // [64][72], after dX
  static constexpr size_t dk = dx + 4 * kC * ld_wide_f;      // f32 [64][D + 4]
  static constexpr size_t small = dk + 4 * kC * Ld<D>::f;    // f32 [6][64]
  static constexpr size_t k = small + 4 * 6 * kC;            // [64][D + 8]
  static constexpr size_t sol = k + 2 * kC * Ld<D>::e;       // [64][2D + 8]: [W | U0]
  static constexpr size_t grads = sol + 2 * kC * ld_wide_e;  // [64][2D + 8]: [dW | du]
  static constexpr size_t dx_e = grads;                      // then dX
  static constexpr size_t t = grads + 2 * kC * ld_wide_e;    // [64][72]: T
  static constexpr size_t bytes = t + 2 * kC * kLdSquareE;
  static_assert(n + 2 * kC * kLdSquareE <= dk, "dA and N fit in the dX space");
};

template <typename T, int D>
__global__ void __launch_bounds__(kThreads) wy_backward_kernel(GatedDeltaArgs p) {
  using L = WyLayout<D>;
  constexpr int kRowsPerWarp = kC / kWarps;
  constexpr int kPerLane = D / 32;
  extern __shared__ __align__(128) unsigned char raw[];
  float* kk = reinterpret_cast<float*>(raw + L::kk);
  float* dx_f = reinterpret_cast<float*>(raw + L::dx);
  float* da = reinterpret_cast<float*>(raw + L::da);
  T* n_bf = reinterpret_cast<T*>(raw + L::n);
  float* dk_f = reinterpret_cast<float*>(raw + L::dk);
  float* g = reinterpret_cast<float*>(raw + L::small);
  float* beta = g + kC;
  float* decay = beta + kC;  // exp(G_r)
  float* dg = decay + kC;
  float* dbeta = dg + kC;
  float* col = dbeta + kC;
  T* k_s = reinterpret_cast<T*>(raw + L::k);
  T* sol = reinterpret_cast<T*>(raw + L::sol);
  T* grads = reinterpret_cast<T*>(raw + L::grads);
  T* dx_bf = reinterpret_cast<T*>(raw + L::dx_e);
  T* t_s = reinterpret_cast<T*>(raw + L::t);
  const ChunkPosition at(p, blockIdx.y, blockIdx.x);
  const T* k = static_cast<const T*>(p.k);
  const T* v = static_cast<const T*>(p.v);
  load_rows<T, D, kThreads>(
      k_s, Ld<D>::e, [&](int r) { return k + at.token(r, D, p.heads, p.tokens); }, at.valid);
  load_rows<T, D, kThreads>(
      sol, L::ld_wide_e, [&](int r) { return static_cast<const T*>(p.w) + at.tile(r, D); }, kC);
  load_rows<T, D, kThreads>(
      sol + D, L::ld_wide_e, [&](int r) { return static_cast<const T*>(p.u0) + at.tile(r, D); },
      kC);
  load_rows<T, D, kThreads>(
      grads + D, L::ld_wide_e, [&](int r) { return static_cast<const T*>(p.du) + at.tile(r, D); },
      kC);
  load_rows<T, kC, kThreads>(
      t_s, kLdSquareE, [&](int r) { return static_cast<const T*>(p.t_inverse) + at.tile(r, kC); },
      kC);
  load_rows<T, D, kThreads>(
      grads, L::ld_wide_e, [&](int r) { return static_cast<const T*>(p.dw) + at.tile(r, D); }, kC);
  load_gate_sums(g, p, at);
  if (threadIdx.x < kC) {
    const int r = threadIdx.x;
    beta[r] = r < at.valid ? p.beta[at.token(r, 1, p.heads, p.tokens)] : 0.f;
  }
  finish_loads();
  __syncthreads();
  if (threadIdx.x < kC) decay[threadIdx.x] = __expf(g[threadIdx.x]);
  gemm<T, kWarps, false, true>(k_s, Ld<D>::e, k_s, Ld<D>::e, kk, kLdSquare, kC, kC, D, false);
  __syncthreads();
  // dX = T^T [dW | du].
  gemm<T, kWarps, true, false>(t_s, kLdSquareE, grads, L::ld_wide_e, dx_f, L::ld_wide_f, kC, 2 * D,
                               kC, false);
  __syncthreads();
  {
    // A warp's rows: dk's start (dk' + diag(beta exp(G)) dX_K), dv, the row sums for dbeta and
    // dG, and dX in the element type. The global rows are read before any sum needs them.
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    float v_rows[kRowsPerWarp][kPerLane], dk_rows[kRowsPerWarp][kPerLane];
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i) {
      const int r = warp + kWarps * i;
      const bool in = r < at.valid;
      const int64_t row = at.token(in ? r : 0, D, p.heads, p.tokens);
#pragma unroll
      for (int j = 0; j < kPerLane; ++j) {
        const int c = lane + 32 * j;
        v_rows[i][j] = in ? to_float(v[row + c]) : 0.f;
        dk_rows[i][j] = p.dk_partial[at.tile(r, D) + c];
      }
    }
    T* dv = static_cast<T*>(p.dv);
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i) {
      const int r = warp + kWarps * i;
      const bool in = r < at.valid;
      const int64_t row = at.token(in ? r : 0, D, p.heads, p.tokens);
      const float xk = beta[r] * decay[r];
      float sk = 0.f, sv = 0.f;
#pragma unroll
      for (int j = 0; j < kPerLane; ++j) {
        const int c = lane + 32 * j;
        const float dxk = dx_f[r * L::ld_wide_f + c], dxv = dx_f[r * L::ld_wide_f + D + c];
        sk += to_float(k_s[r * Ld<D>::e + c]) * dxk;
        sv += v_rows[i][j] * dxv;
        if (in) dv[row + c] = from_float<T>(beta[r] * dxv);
        dk_f[r * Ld<D>::f + c] = dk_rows[i][j] + xk * dxk;
        dx_bf[r * L::ld_wide_e + c] = from_float<T>(dxk);
        dx_bf[r * L::ld_wide_e + D + c] = from_float<T>(dxv);
      }
      sk = warp_sum(sk);
      sv = warp_sum(sv);
      if (lane == 0) {
        dbeta[r] = decay[r] * sk + sv;
        dg[r] = xk * sk;
      }
    }
  }
  __syncthreads();
  // dA = -dX [W | U0]^T (dX's fp32 space is free now).
  gemm<T, kWarps, false, true>(dx_bf, L::ld_wide_e, sol, L::ld_wide_e, da, kLdSquare, kC, kC, 2 * D,
                               false);
  __syncthreads();
  {
    // N and the row sums of dA . A, a warp per row (lanes over two columns each); then the
    // column sums, a warp per column. (A thread per row or column walked 64 entries in turn.)
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
        dg[r] += beta[r] * db;
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
      if (lane == 0) col[s] = sum;
    }
  }
  __syncthreads();
  gemm<T, kWarps, false, false>(n_bf, kLdSquareE, k_s, Ld<D>::e, dk_f, Ld<D>::f, kC, D, kC, true);
  __syncthreads();
  gemm<T, kWarps, true, false>(n_bf, kLdSquareE, k_s, Ld<D>::e, dk_f, Ld<D>::f, kC, D, kC, true);
  __syncthreads();
  T* dk = static_cast<T*>(p.dk);
  store_rows<T, D, kThreads>([&](int r) { return dk + at.token(r, D, p.heads, p.tokens); }, dk_f,
                             Ld<D>::f, at.valid);
  if (threadIdx.x < kC) {
    const int r = threadIdx.x;
    dg[r] +=
        p.dgate_partial[(static_cast<int64_t>(at.bh) * at.chunks + at.chunk) * kC + r] - col[r];
    if (r < at.valid) p.dbeta[at.token(r, 1, p.heads, p.tokens)] = dbeta[r];
  }
  __syncthreads();
  if (threadIdx.x < 32) {
    warp_reverse_running_sum64(dg);
    __syncwarp();
    for (int r = threadIdx.x; r < at.valid; r += 32) {
      p.dgate[at.token(r, 1, p.heads, p.tokens)] = dg[r];
    }
  }
}

template <typename T, int D>
struct WyBackward {
  static cudaError_t launch(const GatedDeltaArgs& a, cudaStream_t stream) {
    return launch_pass(wy_backward_kernel<T, D>, chunk_grid(a), kThreads, WyLayout<D>::bytes, a,
                       stream);
  }
};

}  // namespace

cudaError_t run_wy_backward(const GatedDeltaArgs& a, cudaStream_t stream) {
  return dispatch<WyBackward>(a, stream);
}

}  // namespace gated_delta
}  // namespace mhla_kernels
