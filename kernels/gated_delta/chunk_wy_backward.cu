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
  static constexpr int ld_wide_e = 2 * D + 8;  // element-type rows of [K | V] columns
  static constexpr size_t floats = 3 * kC * kLdSquare + kC * Ld<D>::f + 8 * kC;
  static constexpr size_t bytes =
      sizeof(float) * floats + 2 * (kC * Ld<D>::e + 2 * kC * ld_wide_e + kC * kLdSquareE);
};

// Adds each row's sum over the warp's 32 columns to sums[r] (x[r] holds this lane's column).
__device__ __forceinline__ void add_row_sums(const float (&x)[kC], float* sums) {
#pragma unroll
  for (int r = 0; r < kC; ++r) {
    const float s = warp_sum(x[r]);
    if (threadIdx.x % 32 == 0) atomicAdd(sums + r, s);
  }
}

template <typename T, int D>
__global__ void __launch_bounds__(kThreads) wy_backward_kernel(GatedDeltaArgs p) {
  using L = WyLayout<D>;
  extern __shared__ __align__(128) unsigned char raw[];
  float* kk = reinterpret_cast<float*>(raw);  // [64][68]: K K^T
  float* at_s = kk + kC * kLdSquare;          // [64][68]: A^T
  float* da = at_s + kC * kLdSquare;          // [64][68]
  float* dk_f = da + kC * kLdSquare;          // [64][D + 4]
  float* g = dk_f + kC * Ld<D>::f;            // [64]
  float* beta = g + kC;
  float* decay = beta + kC;  // exp(G_r)
  float* dg = decay + kC;
  float* dbeta = dg + kC;
  float* col = dbeta + kC;
  float* sum_k = col + kC;                    // k_r . dX_K[r]
  float* sum_v = sum_k + kC;                  // v_r . dX_V[r]
  T* k_s = reinterpret_cast<T*>(sum_v + kC);  // [64][D + 8]
  T* sol = k_s + kC * Ld<D>::e;               // [64][2D + 8]: [W | U0]
  T* dx_bf = sol + kC * L::ld_wide_e;         // [64][2D + 8]
  T* n_bf = dx_bf + kC * L::ld_wide_e;        // [64][72]
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
    sum_k[r] = 0.f;
    sum_v[r] = 0.f;
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
  // Column c of dX = (I + A)^-T [dW | du] in registers; from it this column's share of dk (K
  // columns) or dv (V columns) and of the row sums k_r . dX_K[r] and v_r . dX_V[r]. A warp's 32
  // columns are all K or all V columns (D is a multiple of 32).
  T* dv = static_cast<T*>(p.dv);
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
    for (int r = 0; r < kC; ++r) dx_bf[r * L::ld_wide_e + c] = from_float<T>(x[r]);
    float part[kC];
    if (c < D) {
      const float* dk_partial = p.dk_partial + at.tile(0, D) + c;
#pragma unroll
      for (int r = 0; r < kC; ++r) {
        dk_f[r * Ld<D>::f + c] = dk_partial[r * D] + beta[r] * decay[r] * x[r];
        part[r] = to_float(k_s[r * Ld<D>::e + c]) * x[r];
      }
      add_row_sums(part, sum_k);
    } else {
#pragma unroll
      for (int r = 0; r < kC; ++r) {
        const bool in = r < at.valid;
        const int64_t i = at.token(in ? r : 0, D, p.heads, p.tokens) + c - D;
        part[r] = in ? to_float(v[i]) * x[r] : 0.f;
        if (in) dv[i] = from_float<T>(beta[r] * x[r]);
      }
      add_row_sums(part, sum_v);
    }
  }
  __syncthreads();
  if (threadIdx.x < kC) {
    const int r = threadIdx.x;
    dbeta[r] = decay[r] * sum_k[r] + sum_v[r];
    dg[r] = beta[r] * decay[r] * sum_k[r];
  }
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
