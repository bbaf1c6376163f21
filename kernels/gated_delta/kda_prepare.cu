// Prepare pass of the fused KDA (one gate per key dimension): per chunk, the running gate sums G
// [64][D], the scores P (queries against keys, with the diagonal) and the key scores K~ (keys
// against keys, strictly lower, without beta), the WY system A = diag(beta) K~, its inverse T =
// (I + A)^-1 (kept for the backward), W = T diag(beta) (exp(G) . K), U0 = T diag(beta) V, and the
// gated operands of the other passes, exp(G) . Q and exp(G_C - G) . K. One CTA per (chunk,
// batch x head); scores by per_key_scores.cuh, the products with T on tensor cores.
#include "gated_delta/chunk_passes.h"
#include "gated_delta/chunk_tiles.cuh"
#include "gated_delta/per_key_scores.cuh"
#include "gated_delta/unit_lower_inverse.cuh"

namespace mhla_kernels {
namespace gated_delta {
namespace {

constexpr int kThreads = 1024;  // 32 warps: the elementwise phases are latency-bound
constexpr int kWarps = kThreads / 32;

template <int D>
struct KdaPrepareLayout {
  static constexpr size_t q = 0;                               // [64][D + 8]
  static constexpr size_t k = q + 2 * kC * Ld<D>::e;           // [64][D + 8]: K, then X_K
  static constexpr size_t v = k + 2 * kC * Ld<D>::e;           // [64][D + 8]: V, then X_V
  static constexpr size_t g = v + 2 * kC * Ld<D>::e;           // f32 [64][D + 4]: g, then G
  static constexpr size_t beta = g + 4 * kC * Ld<D>::f;        // f32 [64]
  static constexpr size_t scores = beta + 4 * kC;              // f32 [64][68]: P
  static constexpr size_t keys = scores + 4 * kC * kLdSquare;  // f32 [64][68]: K~, then A
  static constexpr size_t t = keys + 4 * kC * kLdSquare;       // [64][72]: T
  static constexpr size_t scratch = t + 2 * kC * kLdSquareE;   // scaled rows, then fp32
  static constexpr size_t scratch_bytes = 2 * kScoresScratchRows * Ld<D>::e;
  // After the scores, scratch holds T in fp32 with the inversion's scratch, then the products.
  static_assert(4 * (kC * kLdSquare + 768) <= scratch_bytes, "inversion fits the scratch");
  static_assert(4 * kC * Ld<D>::f <= scratch_bytes, "products fit the scratch");
  static constexpr size_t bytes = scratch + scratch_bytes;
};

template <typename T, int D>
__global__ void __launch_bounds__(kThreads) kda_prepare_kernel(GatedDeltaArgs p) {
  using L = KdaPrepareLayout<D>;
  constexpr int ldg = Ld<D>::f;
  extern __shared__ __align__(128) unsigned char raw[];
  T* q_s = reinterpret_cast<T*>(raw + L::q);
  T* k_s = reinterpret_cast<T*>(raw + L::k);
  T* v_s = reinterpret_cast<T*>(raw + L::v);
  float* g = reinterpret_cast<float*>(raw + L::g);
  float* beta = reinterpret_cast<float*>(raw + L::beta);
  float* scores = reinterpret_cast<float*>(raw + L::scores);
  float* keys = reinterpret_cast<float*>(raw + L::keys);
  T* t_s = reinterpret_cast<T*>(raw + L::t);
  T* scratch = reinterpret_cast<T*>(raw + L::scratch);
  float* staging = reinterpret_cast<float*>(raw + L::scratch);
  const ChunkPosition at = block_chunk(p);
  load_token_rows<T, D, kThreads>(q_s, Ld<D>::e, p.q, p, at);
  load_token_rows<T, D, kThreads>(k_s, Ld<D>::e, p.k, p, at);
  load_token_rows<T, D, kThreads>(v_s, Ld<D>::e, p.v, p, at);
  load_token_rows<float, D, kThreads>(g, ldg, p.gate, p, at);
  if (threadIdx.x < kC) {
    const int r = threadIdx.x;
    beta[r] = r < at.valid ? p.beta[at.token(r, 1, p.heads, p.tokens)] : 0.f;
  }
  finish_loads();
  __syncthreads();
  // G: running sums down each key dimension (padded rows add 0); the scores tile is free yet.
  running_sums_down_columns<D, kThreads>(g, ldg, scores);
  __syncthreads();
  float* g_out = p.gate_sums + at.tile(0, D);
  for (int e = threadIdx.x; e < kC * (D / 4); e += kThreads) {
    const int r = e / (D / 4), c = (e % (D / 4)) * 4;
    *reinterpret_cast<float4*>(g_out + r * D + c) =
        *reinterpret_cast<const float4*>(g + r * ldg + c);
  }
  per_key_scores<T, D, kThreads, true>(q_s, k_s, g, scratch, scores);
  per_key_scores<T, D, kThreads, false>(k_s, k_s, g, scratch, keys, /*y_copies_ready=*/true);
  // Keep P and K~ (element type), then A = diag(beta) K~ in place.
  T* p_out = static_cast<T*>(p.scores) + at.tile(0, kC);
  T* kk_out = static_cast<T*>(p.key_scores) + at.tile(0, kC);
  for (int e = threadIdx.x; e < kC * kC / 8; e += kThreads) {
    const int r = e / (kC / 8), s = 8 * (e % (kC / 8));
    alignas(16) float x[8], a[8];
    *reinterpret_cast<float4*>(x) = *reinterpret_cast<const float4*>(scores + r * kLdSquare + s);
    *reinterpret_cast<float4*>(x + 4) =
        *reinterpret_cast<const float4*>(scores + r * kLdSquare + s + 4);
    float4* key_row = reinterpret_cast<float4*>(keys + r * kLdSquare + s);
    *reinterpret_cast<float4*>(a) = key_row[0];
    *reinterpret_cast<float4*>(a + 4) = key_row[1];
    store_pack<T, 8>(p_out + r * kC + s, x);
    store_pack<T, 8>(kk_out + r * kC + s, a);
    const float b = beta[r];
    key_row[0] = make_float4(b * a[0], b * a[1], b * a[2], b * a[3]);
    key_row[1] = make_float4(b * a[4], b * a[5], b * a[6], b * a[7]);
  }
  // exp(G) . Q and exp(G_C - G) . K for the other passes, and in place X_K = diag(beta)
  // (exp(G) . K), X_V = diag(beta) V: one thread reads and then rewrites its own elements.
  T* q_gated = static_cast<T*>(p.q_gated) + at.tile(0, D);
  T* k_to_end = static_cast<T*>(p.k_to_end) + at.tile(0, D);
  for (int e = threadIdx.x; e < kC * (D / 8); e += kThreads) {
    const int r = e / (D / 8), c = 8 * (e % (D / 8));
    alignas(16) float gr[8], ge[8];
    float qx[8], kx[8], vx[8], decay[8];
    *reinterpret_cast<float4*>(gr) = *reinterpret_cast<const float4*>(g + r * ldg + c);
    *reinterpret_cast<float4*>(gr + 4) = *reinterpret_cast<const float4*>(g + r * ldg + c + 4);
    *reinterpret_cast<float4*>(ge) = *reinterpret_cast<const float4*>(g + (kC - 1) * ldg + c);
    *reinterpret_cast<float4*>(ge + 4) =
        *reinterpret_cast<const float4*>(g + (kC - 1) * ldg + c + 4);
    load_pack<T, 8>(q_s + r * Ld<D>::e + c, qx);
    load_pack<T, 8>(k_s + r * Ld<D>::e + c, kx);
    load_pack<T, 8>(v_s + r * Ld<D>::e + c, vx);
    const float b = beta[r];
    float to_end[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      decay[j] = __expf(gr[j]);
      to_end[j] = kx[j] * __expf(ge[j] - gr[j]);
      qx[j] *= decay[j];
      kx[j] *= b * decay[j];
      vx[j] *= b;
    }
    store_pack<T, 8>(q_gated + r * D + c, qx);
    store_pack<T, 8>(k_to_end + r * D + c, to_end);
    store_pack<T, 8>(k_s + r * Ld<D>::e + c, kx);
    store_pack<T, 8>(v_s + r * Ld<D>::e + c, vx);
  }
  invert_unit_lower<kThreads>(keys, staging, staging + kC * kLdSquare);  // syncs first
  keep_inverse<T, kThreads>(staging, t_s, static_cast<T*>(p.t_inverse) + at.tile(0, kC));
  __syncthreads();
  for (int half = 0; half < 2; ++half) {
    gemm<T, kWarps, false, false, kWarps / 2>(t_s, kLdSquareE, half == 0 ? k_s : v_s, Ld<D>::e,
                                              staging, Ld<D>::f, kC, D, kC, false);
    __syncthreads();
    T* dst = static_cast<T*>(half == 0 ? p.w : p.u0) + at.tile(0, D);
    store_rows<T, D, kThreads>([&](int r) { return dst + r * D; }, staging, Ld<D>::f, kC);
    __syncthreads();
  }
}

template <typename T, int D>
struct KdaPrepare {
  static cudaError_t launch(const GatedDeltaArgs& a, cudaStream_t stream) {
    return launch_pass(kda_prepare_kernel<T, D>, chunk_grid(a), kThreads,
                       KdaPrepareLayout<D>::bytes, a, stream);
  }
};

}  // namespace

cudaError_t run_kda_prepare(const GatedDeltaArgs& a, cudaStream_t stream) {
  return dispatch<KdaPrepare>(a, stream);
}

}  // namespace gated_delta
}  // namespace mhla_kernels
