// The forward output of a chunk, o = scale [(exp(G) . Q) S_i + P u] with the decayed causal
// scores P = (Q K^T) . D (D_rs = exp(G_r - G_s), s <= r). One CTA per (chunk, batch x head,
// half of the value columns), products on tensor cores with fp32 accumulation. Gated DeltaNet
// forms P here and keeps it (the backward's state walk reads it for P^T dO); KDA reads P and
// exp(G) . Q from its prepare pass instead.
#include "gated_delta/chunk_passes.h"
#include "gated_delta/chunk_tiles.cuh"

namespace mhla_kernels {
namespace gated_delta {
namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;

// The output pass splits the value columns over CTAs (kOutputCols each): with the fp32 result
// tile sharing the scores' space, two CTAs fit an SM at D = 128.
constexpr int kOutputCols = 64;
constexpr int kLdOutE = kOutputCols + 8;

template <int D>
constexpr size_t output_bytes() {
  return sizeof(float) * (kC * kLdSquare + 2 * kC) +
         2 * (2 * kC * Ld<D>::e + kC * kLdOutE + D * kLdOutE + kC * kLdSquareE);
}

// P into p_bf (element type, zeros above the diagonal); q_s and k_s hold the raw rows, g the
// gate sums; pf is fp32 scratch. Ends synchronized.
template <typename T, int D>
__device__ void decayed_scores(const T* q_s, const T* k_s, const float* g, float* pf, T* p_bf) {
  gemm<T, kWarps, false, true, kWarps / 4>(q_s, Ld<D>::e, k_s, Ld<D>::e, pf, kLdSquare, kC, kC, D,
                                           false);
  __syncthreads();
  causal_decayed<T, kThreads>(p_bf, pf, g);
  __syncthreads();
}

template <typename T, int D, bool PerKey>
__global__ void __launch_bounds__(kThreads) output_kernel(GatedDeltaArgs p) {
  constexpr int kCols = D < kOutputCols ? D : kOutputCols;
  extern __shared__ __align__(128) unsigned char raw[];
  float* pf = reinterpret_cast<float*>(raw);  // [64][68]: scores, then the output tile
  float* g = pf + kC * kLdSquare;             // [64]
  float* decay = g + kC;                      // [64]: exp(G_r)
  T* q_s = reinterpret_cast<T*>(decay + kC);  // [64][D + 8]
  T* k_s = q_s + kC * Ld<D>::e;               // [64][D + 8]
  T* u_s = k_s + kC * Ld<D>::e;               // [64][72]: this CTA's columns of u
  T* st_s = u_s + kC * kLdOutE;               // [D][72]: of S_i
  T* p_bf = st_s + D * kLdOutE;               // [64][72]
  const ChunkPosition at = block_chunk(p);
  const int col0 = blockIdx.z * kCols;
  load_matrix<T, kC, kCols, kThreads>(u_s, kLdOutE,
                                      static_cast<const T*>(p.u) + at.tile(0, D) + col0, D);
  load_matrix<T, D, kCols, kThreads>(st_s, kLdOutE,
                                     static_cast<const T*>(p.states) + at.state(D) + col0, D);
  if constexpr (PerKey) {  // exp(G) . Q and P from the prepare pass
    load_matrix<T, kC, D, kThreads>(q_s, Ld<D>::e, static_cast<const T*>(p.q_gated) + at.tile(0, D),
                                    D);
    load_matrix<T, kC, kC, kThreads>(p_bf, kLdSquareE,
                                     static_cast<const T*>(p.scores) + at.tile(0, kC), kC);
    finish_loads();
    __syncthreads();
  } else {
    load_token_rows<T, D, kThreads>(q_s, Ld<D>::e, p.q, p, at);
    load_token_rows<T, D, kThreads>(k_s, Ld<D>::e, p.k, p, at);
    load_gate_sums(g, p, at);
    finish_loads();
    __syncthreads();
    if (threadIdx.x < kC) decay[threadIdx.x] = __expf(g[threadIdx.x]);
    decayed_scores<T, D>(q_s, k_s, g, pf, p_bf);
    if (blockIdx.z == 0) {  // kept for the backward (one CTA of the chunk stores it)
      store_matrix<T, kC, kC, kThreads>(static_cast<T*>(p.scores) + at.tile(0, kC), kC, p_bf,
                                        kLdSquareE);
    }
    for (int e = threadIdx.x; e < kC * (D / 8); e += kThreads) {
      const int r = e / (D / 8), c = 8 * (e % (D / 8));
      float x[8];
      load_pack<T, 8>(q_s + r * Ld<D>::e + c, x);
#pragma unroll
      for (int j = 0; j < 8; ++j) x[j] *= decay[r];
      store_pack<T, 8>(q_s + r * Ld<D>::e + c, x);
    }
    __syncthreads();
  }
  float* out_f = pf;  // [64][68]
  gemm<T, kWarps, false, false, kWarps / 4>(q_s, Ld<D>::e, st_s, kLdOutE, out_f, kLdSquare, kC,
                                            kCols, D, false);
  __syncthreads();
  gemm<T, kWarps, false, false, kWarps / 4>(p_bf, kLdSquareE, u_s, kLdOutE, out_f, kLdSquare, kC,
                                            kCols, kC, true);
  __syncthreads();
  T* out = static_cast<T*>(p.out) + col0;
  store_rows<T, kCols, kThreads>([&](int r) { return out + at.token(r, D, p.heads, p.tokens); },
                                 out_f, kLdSquare, at.valid, p.scale);
}

template <typename T, int D>
struct Output {
  static cudaError_t launch(const GatedDeltaArgs& a, cudaStream_t stream) {
    const dim3 grid = chunk_grid(a, D < kOutputCols ? 1 : D / kOutputCols);
    return a.per_key_gate ? launch_pass(output_kernel<T, D, true>, grid, kThreads,
                                        output_bytes<D>(), a, stream)
                          : launch_pass(output_kernel<T, D, false>, grid, kThreads,
                                        output_bytes<D>(), a, stream);
  }
};

}  // namespace

cudaError_t run_output(const GatedDeltaArgs& a, cudaStream_t stream) {
  return dispatch<Output>(a, stream);
}

}  // namespace gated_delta
}  // namespace mhla_kernels
