// The backward of the fused gated DeltaNet's WY system, per chunk: with [W | U0] = (I + A)^-1 X,
// X = [diag(beta exp(G)) K | diag(beta) V] and the gradients dW (chunk_gradients.cu) and du
// (the states' backward pass):
//   dX = (I + A)^-T [dW | du]                     (one thread per column, fp32 registers)
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

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

template <int D>
struct WyLayout {
  static constexpr int ld_wide_f = 2 * D + 4;  // fp32 rows of [K | V] columns
  static constexpr int ld_wide_e = 2 * D + 8;  // element-type rows of them
  static constexpr size_t wide_floats = static_cast<size_t>(kC) * ld_wide_f;
  static constexpr size_t floats = 2 * kC * kLdSquare + wide_floats + kC * Ld<D>::f + 6 * kC;
  static constexpr size_t bytes = sizeof(float) * floats + 2 * (kC * Ld<D>::e + 2 * kC * ld_wide_e);
  static_assert(sizeof(float) * kC * kLdSquare + 2 * kC * kLdSquareE <= sizeof(float) * wide_floats,
                "dA and N reuse the dX region");
};

template <typename T, int D>
__global__ void __launch_bounds__(kThreads) wy_backward_kernel(GatedDeltaArgs p) {
  using L = WyLayout<D>;
  extern __shared__ __align__(128) unsigned char raw[];
  float* kk = reinterpret_cast<float*>(raw);  // [64][68]: K K^T
  float* at_s = kk + kC * kLdSquare;          // [64][68]: A^T
  float* dx_f = at_s + kC * kLdSquare;        // [64][2D + 4]: dX; later dA and N
  float* dk_f = dx_f + L::wide_floats;        // [64][D + 4]
  float* g = dk_f + kC * Ld<D>::f;            // [64]
  float* beta = g + kC;
  float* decay = beta + kC;  // exp(G_r)
  float* dg = decay + kC;
  float* dbeta = dg + kC;
  float* col = dbeta + kC;
  T* k_s = reinterpret_cast<T*>(col + kC);              // [64][D + 8]
  T* sol = k_s + kC * Ld<D>::e;                         // [64][2D + 8]: [W | U0]
  T* dx_bf = sol + kC * L::ld_wide_e;                   // [64][2D + 8]
  float* da = dx_f;                                     // [64][68], after dX is read
  T* n_bf = reinterpret_cast<T*>(da + kC * kLdSquare);  // [64][72]
  const ChunkPosition at(p, blockIdx.y, blockIdx.x);
  const T* k = static_cast<const T*>(p.k);
  const T* v = static_cast<const T*>(p.v);
  load_rows<T, D, kThreads>(
      k_s, Ld<D>::e, [&](int r) { return k + at.token(r, D, p.heads, p.tokens); }, at.valid,
      nullptr);
  load_rows<T, D, kThreads>(
      sol, L::ld_wide_e, [&](int r) { return static_cast<const T*>(p.w) + at.tile(r, D); }, kC,
      nullptr);
  load_rows<T, D, kThreads>(
      sol + D, L::ld_wide_e, [&](int r) { return static_cast<const T*>(p.u0) + at.tile(r, D); }, kC,
      nullptr);
  load_gate_sums(g, p, at);
  if (threadIdx.x < kC) {
    const int r = threadIdx.x;
    beta[r] = r < at.valid ? p.beta[at.token(r, 1, p.heads, p.tokens)] : 0.f;
  }
  __syncthreads();
  if (threadIdx.x < kC) decay[threadIdx.x] = __expf(g[threadIdx.x]);
  gemm<T, kWarps, false, true>(k_s, Ld<D>::e, k_s, Ld<D>::e, kk, kLdSquare, kC, kC, D, false);
  __syncthreads();
  for (int e = threadIdx.x; e < kC * kC; e += kThreads) {
    const int r = e / kC, s = e % kC;
    at_s[s * kLdSquare + r] = s < r ? beta[r] * kk[r * kLdSquare + s] * __expf(g[r] - g[s]) : 0.f;
  }
  __syncthreads();
  for (int c = threadIdx.x; c < 2 * D; c += kThreads) {
    float x[kC];
    if (c < D) {
      const float* dw = p.dw + at.tile(0, D) + c;
#pragma unroll
      for (int r = 0; r < kC; ++r) x[r] = dw[r * D];
    } else {
      const T* du = static_cast<const T*>(p.du) + at.tile(0, D) + c - D;
#pragma unroll
      for (int r = 0; r < kC; ++r) x[r] = to_float(du[r * D]);
    }
    backward_substitute(at_s, x);
#pragma unroll
    for (int r = 0; r < kC; ++r) {
      dx_f[r * L::ld_wide_f + c] = x[r];
      dx_bf[r * L::ld_wide_e + c] = from_float<T>(x[r]);
    }
  }
  __syncthreads();
  {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    T* dv = static_cast<T*>(p.dv);
    const float* dk_partial = p.dk_partial + at.tile(0, D);
    for (int r = warp; r < kC; r += kWarps) {
      const bool in = r < at.valid;
      const int64_t row = at.token(r, D, p.heads, p.tokens);
      const float xk = beta[r] * decay[r];
      float sk = 0.f, sv = 0.f;
      for (int c = lane; c < D; c += 32) {
        const float dxk = dx_f[r * L::ld_wide_f + c], dxv = dx_f[r * L::ld_wide_f + D + c];
        sk += to_float(k_s[r * Ld<D>::e + c]) * dxk;
        if (in) {
          sv += to_float(v[row + c]) * dxv;
          dv[row + c] = from_float<T>(beta[r] * dxv);
        }
        dk_f[r * Ld<D>::f + c] = dk_partial[r * D + c] + xk * dxk;
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
  gemm<T, kWarps, false, true>(dx_bf, L::ld_wide_e, sol, L::ld_wide_e, da, kLdSquare, kC, kC, 2 * D,
                               false);
  __syncthreads();
  if (threadIdx.x < kC) {
    const int r = threadIdx.x;
    float db = 0.f, dgr = 0.f;
    for (int s = 0; s < kC; ++s) {
      float n = 0.f;
      if (s < r) {
        const float d_a = -da[r * kLdSquare + s], e = __expf(g[r] - g[s]);
        const float kke = kk[r * kLdSquare + s] * e;
        db += d_a * kke;
        dgr += d_a * beta[r] * kke;
        n = d_a * beta[r] * e;
      }
      n_bf[r * kLdSquareE + s] = from_float<T>(n);
    }
    dbeta[r] += db;
    dg[r] += dgr;
  } else if (threadIdx.x < 2 * kC) {
    const int s = threadIdx.x - kC;
    float sum = 0.f;
    for (int r = s + 1; r < kC; ++r) sum -= da[r * kLdSquare + s] * at_s[s * kLdSquare + r];
    col[s] = sum;  // sum_r dA_rs A_rs
  }
  __syncthreads();
  gemm<T, kWarps, false, false>(n_bf, kLdSquareE, k_s, Ld<D>::e, dk_f, Ld<D>::f, kC, D, kC, true);
  __syncthreads();
  gemm<T, kWarps, true, false>(n_bf, kLdSquareE, k_s, Ld<D>::e, dk_f, Ld<D>::f, kC, D, kC, true);
  __syncthreads();
  T* dk = static_cast<T*>(p.dk);
  for (int e = threadIdx.x; e < at.valid * (D / 8); e += kThreads) {
    const int r = e / (D / 8), c = (e % (D / 8)) * 8;
    float x[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) x[j] = dk_f[r * Ld<D>::f + c + j];
    store_pack<T, 8>(dk + at.token(r, D, p.heads, p.tokens) + c, x);
  }
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
    constexpr size_t bytes = WyLayout<D>::bytes;
    if (cudaError_t err = allow_shared(wy_backward_kernel<T, D>, bytes); err != cudaSuccess) {
      return err;
    }
    const dim3 grid(gated_delta_chunks(a.tokens), a.batch * a.heads);
    wy_backward_kernel<T, D><<<grid, kThreads, bytes, stream>>>(a);
    return cudaGetLastError();
  }
};

}  // namespace

cudaError_t run_wy_backward(const GatedDeltaArgs& a, cudaStream_t stream) {
  return dispatch<WyBackward>(a, stream);
}

}  // namespace gated_delta
}  // namespace mhla_kernels
