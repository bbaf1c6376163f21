// KDA backward, the part of a chunk's gradients that flows through its scores P (o = scale
// [(exp(G) . Q) S_i + P u], P_ts = sum_d q_td k_td exp(G_td - G_sd), s <= t): with dP = scale dO
// u^T (lower), per_key_scores_backward gives R = dL/dq and C = dL/dk through P, and the gate
// sums' gradient through P is Q . R - K . C. Written as the starting values of dq_partial,
// dk_partial and dgate_partial (kda_state_grads.cu and the WY backward add the rest). Needs only
// the forward's u, so it runs first. One CTA per (chunk, batch x head).
#include "gated_delta/chunk_passes.h"
#include "gated_delta/chunk_tiles.cuh"
#include "gated_delta/per_key_scores.cuh"

namespace mhla_kernels {
namespace gated_delta {
namespace {

constexpr int kThreads = 1024;  // 32 warps: the elementwise phases are latency-bound
constexpr int kWarps = kThreads / 32;

template <int D>
struct IntraLayout {
  static constexpr size_t q = 0;                           // [64][D + 8]
  static constexpr size_t k = q + 2 * kC * Ld<D>::e;       // [64][D + 8]
  static constexpr size_t g = k + 2 * kC * Ld<D>::e;       // f32 [64][D + 4]: G
  static constexpr size_t r = g + 4 * kC * Ld<D>::f;       // f32 [64][D + 4]: dL/dq via P
  static constexpr size_t c = r + 4 * kC * Ld<D>::f;       // f32 [64][D + 4]: dL/dk via P
  static constexpr size_t m = c + 4 * kC * Ld<D>::f;       // [64][72]: dP
  static constexpr size_t work = m + 2 * kC * kLdSquareE;  // dO, u, dP (fp32), then scratch
  static constexpr size_t d_out = work, u = d_out + 2 * kC * Ld<D>::e,
                          dp = u + 2 * kC * Ld<D>::e;  // f32 [64][68]
  static constexpr size_t work_bytes_inputs = dp + 4 * kC * kLdSquare - work;
  static constexpr size_t work_bytes_scratch = 2 * kScoresBackwardScratchRows * Ld<D>::e;
  static constexpr size_t bytes =
      work + (work_bytes_inputs > work_bytes_scratch ? work_bytes_inputs : work_bytes_scratch);
};

template <typename T, int D>
__global__ void __launch_bounds__(kThreads) kda_intra_grads_kernel(GatedDeltaArgs p) {
  using L = IntraLayout<D>;
  constexpr int ldg = Ld<D>::f;
  extern __shared__ __align__(128) unsigned char raw[];
  T* q_s = reinterpret_cast<T*>(raw + L::q);
  T* k_s = reinterpret_cast<T*>(raw + L::k);
  float* g = reinterpret_cast<float*>(raw + L::g);
  float* r_f = reinterpret_cast<float*>(raw + L::r);
  float* c_f = reinterpret_cast<float*>(raw + L::c);
  T* m_bf = reinterpret_cast<T*>(raw + L::m);
  T* do_s = reinterpret_cast<T*>(raw + L::d_out);
  T* u_s = reinterpret_cast<T*>(raw + L::u);
  float* dp = reinterpret_cast<float*>(raw + L::dp);
  T* scratch = reinterpret_cast<T*>(raw + L::work);
  const ChunkPosition at(p, blockIdx.y, blockIdx.x);
  auto rows = [&](const void* base) {
    return [&at, &p, base](int r) {
      return static_cast<const T*>(base) + at.token(r, D, p.heads, p.tokens);
    };
  };
  load_rows<T, D, kThreads>(q_s, Ld<D>::e, rows(p.q), at.valid);
  load_rows<T, D, kThreads>(k_s, Ld<D>::e, rows(p.k), at.valid);
  load_rows<T, D, kThreads>(do_s, Ld<D>::e, rows(p.d_out), at.valid);
  load_matrix<T, kC, D, kThreads>(u_s, Ld<D>::e, static_cast<const T*>(p.u) + at.tile(0, D), D);
  load_matrix<float, kC, D, kThreads>(g, ldg, p.gate_sums + at.tile(0, D), D);
  finish_loads();
  __syncthreads();
  gemm<T, kWarps, false, true>(do_s, Ld<D>::e, u_s, Ld<D>::e, dp, kLdSquare, kC, kC, D, false);
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
    for (int j = 0; j < 8; ++j) {
      x[j] = s0 + j <= t ? p.scale * dp[t * kLdSquare + s0 + j] : 0.f;
    }
    store_pack<T, 8>(m_bf + t * kLdSquareE + s0, x);
  }
  __syncthreads();
  per_key_scores_backward<T, D, kThreads>(m_bf, q_s, k_s, g, scratch, r_f, c_f);
  float* dq = p.dq_partial + at.tile(0, D);
  float* dk = p.dk_partial + at.tile(0, D);
  float* dg = p.dgate_partial + at.tile(0, D);
  for (int e = threadIdx.x; e < kC * (D / 4); e += kThreads) {
    const int t = e / (D / 4), d = 4 * (e % (D / 4));
    const float4 rq = *reinterpret_cast<const float4*>(r_f + t * ldg + d);
    const float4 ck = *reinterpret_cast<const float4*>(c_f + t * ldg + d);
    float qx[4], kx[4];
    load_pack<T, 4>(q_s + t * Ld<D>::e + d, qx);
    load_pack<T, 4>(k_s + t * Ld<D>::e + d, kx);
    *reinterpret_cast<float4*>(dq + t * D + d) = rq;
    *reinterpret_cast<float4*>(dk + t * D + d) = ck;
    *reinterpret_cast<float4*>(dg + t * D + d) =
        make_float4(qx[0] * rq.x - kx[0] * ck.x, qx[1] * rq.y - kx[1] * ck.y,
                    qx[2] * rq.z - kx[2] * ck.z, qx[3] * rq.w - kx[3] * ck.w);
  }
}

template <typename T, int D>
struct KdaIntraGrads {
  static cudaError_t launch(const GatedDeltaArgs& a, cudaStream_t stream) {
    return launch_pass(kda_intra_grads_kernel<T, D>, chunk_grid(a), kThreads, IntraLayout<D>::bytes,
                       a, stream);
  }
};

}  // namespace

cudaError_t run_kda_intra_grads(const GatedDeltaArgs& a, cudaStream_t stream) {
  return dispatch<KdaIntraGrads>(a, stream);
}

}  // namespace gated_delta
}  // namespace mhla_kernels
