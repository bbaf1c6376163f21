// Per-chunk gradients of the fused gated DeltaNet, in one pass after the states' backward pass.
// One CTA per (chunk, batch x head). With dO' = scale dO, P = (Q K^T) . D, the chunk's u and du
// (the total gradient of u), S_i and the gradient dS_{i+1} of the state leaving the chunk:
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
//
// Four warpgroups; every product with a 64-row result whose operands are K-major (Q K^T, dO u^T,
// K K^T, dO S^T, u dS^T, du S^T, dX [W | U0]^T) is one warpgroup's wgmma from shared memory, its
// 64 x N result in that group's registers, where the row and column sums, the decays and the
// scalings are applied. The products with a transposed operand (M K, M^T Q, T^T dW, T^T du, N K,
// N^T K; depth 64, triangular) continue on the same registers with each warp's mma.sync over its
// 16 rows, skipping the blocks the triangle zeroes. Only M, dW, dX and N go through shared memory
// (as operands, in the element type); dk' stays in one group's registers from the first phase to
// the store.
//   phase 1: group 0 P, dP^ -> M and the score sums; group 1 dO S^T (kept);
//            group 2 u dS^T -> dk' (kept); group 3 dW, sum(S_i . dS).
//   phase 2: group 1 dq; group 2 dk' += M^T Q, dX_K; groups 0 and 3 dX_V, dv (column halves).
//   phase 3: group 0 K K^T and dA -> N, its sums.   phase 4: group 2 dk' += N K + N^T K, dk; group 1 dbeta, dg.
#include "common/warpgroup_mma.cuh"
#include "gated_delta/chunk_passes.h"
#include "gated_delta/chunk_tiles.cuh"

namespace mhla_kernels {
namespace gated_delta {
namespace {

namespace wg = warpgroup;
using wg::CoreTile;

constexpr int kThreads = 512;

// Shared memory (bytes). Element-type core tiles, then the per-row fp32 arrays. W and U0 stream
// in over dO and u once phase 1 is done with them, dX_K and dX_V are written over dS and S_i,
// N over M.
template <int D>
struct GradsLayout {
  static constexpr size_t tile = 2 * kC * D;   // [64][D]
  static constexpr size_t state = 2 * D * D;   // [D][D]
  static constexpr size_t square = 2 * kC * kC;  // [64][64]
  static constexpr size_t q = 0, k = q + tile, d_out = k + tile, u = d_out + tile,
                          du = u + tile, v = du + tile, st = v + tile, ds = st + state,
                          t = ds + state, m = t + square, dw = m + square, rows = dw + tile;
  static constexpr size_t w = d_out, u0 = u, dxk = ds, dxv = st, n = m;
  static_assert(tile <= state, "dX_K and dX_V fit over dS and S_i");
  static constexpr int kRowArrays = 24;  // per-row arrays of 64 floats (see the kernel)
  static constexpr size_t bytes = rows + 4 * (kRowArrays * kC + 32);
};

// Per-thread view of the two rows a thread's accumulator elements lie on.
__device__ __forceinline__ int row_of(int i) { return wg::acc_row(i); }
__device__ __forceinline__ bool upper_row(int i) { return (i % 4) >= 2; }

// Sums of the thread's values on its two rows over the four lanes that share them; lane % 4 == 0
// writes them to out[row].
__device__ __forceinline__ void store_row_sums(float lo, float hi, float* out) {
  lo += __shfl_xor_sync(0xffffffffu, lo, 1);
  lo += __shfl_xor_sync(0xffffffffu, lo, 2);
  hi += __shfl_xor_sync(0xffffffffu, hi, 1);
  hi += __shfl_xor_sync(0xffffffffu, hi, 2);
  if (threadIdx.x % 4 == 0) {
    const int r = row_of(0);
    out[r] = lo;
    out[r + 8] = hi;
  }
}

// Column sums of a 64 x 64 accumulator over the warp's 16 rows, into part[warp % 4][column]
// (summed over the four warps later, in a fixed order).
__device__ __forceinline__ void store_column_sums(const float (&x)[32], float* part) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int i = 0; i < 32; i += 4) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float s = x[i + h] + x[i + h + 2];
      s += __shfl_xor_sync(0xffffffffu, s, 4);
      s += __shfl_xor_sync(0xffffffffu, s, 8);
      s += __shfl_xor_sync(0xffffffffu, s, 16);
      if (lane < 4) part[((threadIdx.x / 32) % 4) * kC + wg::acc_col(i + h)] = s;
    }
  }
}

// sum_c X[r][c0 + c] acc[r][c] per row r of the thread (X a core tile read at the accumulator's
// positions: a warp's 4-byte reads cover one core matrix, no bank conflicts).
template <typename T, int R, int L>
__device__ __forceinline__ void row_dots(CoreTile<T, L> x, int c0, const float (&acc)[R],
                                         float& lo, float& hi) {
#pragma unroll
  for (int i = 0; i < R; i += 2) {
    const auto pair = *reinterpret_cast<const typename std::conditional_t<
        std::is_same_v<T, __nv_bfloat16>, __nv_bfloat162, __half2>*>(
        x.at(row_of(i), c0 + wg::acc_col(i)));
    const float d = to_float(pair.x) * acc[i] + to_float(pair.y) * acc[i + 1];
    if (upper_row(i)) hi += d; else lo += d;
  }
}

// The accumulator's rows r < valid into a token-major global matrix (rows `stride` apart).
template <typename T, int R>
__device__ __forceinline__ void store_global_rows(T* row0, int stride, int valid, int c0,
                                                  const float (&acc)[R]) {
#pragma unroll
  for (int i = 0; i < R; i += 2) {
    const int r = row_of(i);
    if (r < valid) {
      *reinterpret_cast<unsigned*>(row0 + static_cast<int64_t>(r) * stride + c0 + wg::acc_col(i)) =
          wg::pack_pair<T>(acc[i], acc[i + 1]);
    }
  }
}

template <int R>
__device__ __forceinline__ void zero(float (&x)[R]) {
#pragma unroll
  for (int i = 0; i < R; ++i) x[i] = 0.f;
}

// What every group reads: the shared tiles, the per-row arrays and the chunk's position.
template <typename T, int D>
struct Chunk {
  using L = GradsLayout<D>;
  CoreTile<T, D> q, k, d_out, u, du, v, st, ds, dw, w, u0, dxk, dxv;
  CoreTile<T, kC> t, m, n;
  float *g, *beta, *gate, *decay, *to_end;  // G, beta, exp(G), scale exp(G), exp(G_C - G)
  float* score_rows;  // rowsum(dP^ . P)
  float* score_cols;  // [4][64]: colsum(dP^ . P), per warp of group 0
  float* q_dots;      // rowsum(Q . dO S^T)
  float* k_dots;      // rowsum(K . u dS^T)
  float* xk_dots;     // k_r . dX_K[r]
  float* xv_dots;     // [2][64]: v_r . dX_V[r], per column half
  float* a_rows;      // sum_s dA_rs (k_r . k_s) E_rs
  float* a_cols;      // [4][64]: sum_r dA_rs A_rs, per warp of group 0
  float* dg_sum;      // dG, then its reverse running sum
  float* state_part;  // [4]: sum(S_i . dS), per warp of group 3
  ChunkPosition at;
  int strip;  // the warp's first row in its group's 64 x N results

  __device__ Chunk(unsigned char* raw, const GatedDeltaArgs& p) : at(block_chunk(p)) {
    auto tile = [&](size_t o) { return CoreTile<T, D>{reinterpret_cast<T*>(raw + o)}; };
    auto square = [&](size_t o) { return CoreTile<T, kC>{reinterpret_cast<T*>(raw + o)}; };
    q = tile(L::q), k = tile(L::k), d_out = tile(L::d_out), u = tile(L::u), du = tile(L::du);
    v = tile(L::v), st = tile(L::st), ds = tile(L::ds), dw = tile(L::dw), w = tile(L::w);
    u0 = tile(L::u0), dxk = tile(L::dxk), dxv = tile(L::dxv);
    t = square(L::t), m = square(L::m), n = square(L::n);
    float* f = reinterpret_cast<float*>(raw + L::rows);
    g = f, beta = g + kC, gate = beta + kC, decay = gate + kC, to_end = decay + kC;
    score_rows = to_end + kC, score_cols = score_rows + kC, q_dots = score_cols + 4 * kC;
    k_dots = q_dots + kC, xk_dots = k_dots + kC, xv_dots = xk_dots + kC;
    a_rows = xv_dots + 2 * kC, a_cols = a_rows + kC, dg_sum = a_cols + 4 * kC;
    state_part = dg_sum + kC;
    strip = 16 * ((threadIdx.x / 32) % 4);
  }
  __device__ T* token_row0(void* base, const GatedDeltaArgs& p) const {
    return static_cast<T*>(base) + at.token(0, D, p.heads, p.tokens);
  }
  __device__ const T* chunk_row0(const void* base) const {
    return static_cast<const T*>(base) + at.tile(0, D);
  }
  // W and U0 stream in over dO and u, which phase 1 is done with: issued by every thread at the
  // start of phase 2, awaited at its end.
  __device__ void stream_wy_operands(const GatedDeltaArgs& p) const {
    wg::copy_rows_async<T, kC, D, kThreads>(w, chunk_row0(p.w), D, kC);
    wg::copy_rows_async<T, kC, D, kThreads>(u0, chunk_row0(p.u0), D, kC);
    copy_async_commit();
  }
  __device__ void await_wy_operands() const {
    copy_async_wait<0>();
    wg::fence_shared_for_mma();
  }
};
static_assert(GradsLayout<64>::kRowArrays >= 5 + 1 + 4 + 4 + 2 + 1 + 4 + 1 + 1, "row arrays");

// The kernel's barriers: every thread passes each of them once, from its group's code.
__device__ __forceinline__ void barrier() { asm volatile("bar.sync 0;\n" ::: "memory"); }

// Groups 0 and 3: dX_V = T^T du for half of the columns (T^T's row s has r >= s): dv, the row
// dots with v, and the element type for dA.
template <typename T, int D>
__device__ void value_gradient_half(const Chunk<T, D>& c, const GatedDeltaArgs& p, int half) {
  constexpr int kHalf = D / 2;
  float x[kHalf / 2], lo = 0.f, hi = 0.f;
  zero(x);
  wg::strip_product<T, true, false, kHalf / 16>(x, 0, c.t, c.strip, c.du, half * kHalf, c.strip,
                                                kC);
  row_dots(c.v, half * kHalf, x, lo, hi);
  store_row_sums(lo, hi, c.xv_dots + half * kC);
  wg::store_accumulator(c.dxv, 0, half * kHalf, x);
  const float b_lo = c.beta[row_of(0)], b_hi = c.beta[row_of(2)];
#pragma unroll
  for (int i = 0; i < kHalf / 2; ++i) x[i] *= upper_row(i) ? b_hi : b_lo;
  store_global_rows<T>(c.token_row0(p.dv, p), p.heads * D, c.at.valid, half * kHalf, x);
}

// Group 0: the scores (M and the score sums), then K K^T and dA (N and its sums).
template <typename T, int D>
__device__ void scores_and_wy_group(const Chunk<T, D>& c, const GatedDeltaArgs& p) {
  {
    float scores[32], dscores[32], lo = 0.f, hi = 0.f;
    wg::fence();
    wg::product<T, kC, D>(scores, c.q, 0, 0, c.k, 0, 0, false);
    wg::product<T, kC, D>(dscores, c.d_out, 0, 0, c.u, 0, 0, false);
    wg::wait<0>();
    wg::pin(scores);
    wg::pin(dscores);
    // t = dP^ . P . D (for the gate sums) and M = dP^ . D, causal.
#pragma unroll
    for (int i = 0; i < 32; ++i) {
      const int r = row_of(i), s = wg::acc_col(i);
      float t = 0.f, mv = 0.f;
      if (s <= r) {
        const float d = __expf(c.g[r] - c.g[s]), dp = p.scale * dscores[i];
        t = dp * scores[i] * d;
        mv = dp * d;
      }
      scores[i] = t;
      dscores[i] = mv;
      if (upper_row(i)) hi += t; else lo += t;
    }
    store_row_sums(lo, hi, c.score_rows);
    store_column_sums(scores, c.score_cols);
    wg::store_accumulator(c.m, 0, 0, dscores);
  }
  barrier();  // phase 2
  c.stream_wy_operands(p);
  value_gradient_half<T, D>(c, p, 0);  // the first half of dX_V's columns
  c.await_wy_operands();
  barrier();  // phase 3
  {
    // dA = -dX [W | U0]^T (strictly lower) beside K K^T: N and its sums.
    float kk[32], da[32], lo = 0.f, hi = 0.f;
    wg::fence();
    wg::product<T, kC, D>(kk, c.k, 0, 0, c.k, 0, 0, false);
    wg::product<T, kC, D>(da, c.dxk, 0, 0, c.w, 0, 0, false);
    wg::product<T, kC, D>(da, c.dxv, 0, 0, c.u0, 0, 0, true);
    wg::wait<0>();
    wg::pin(kk);
    wg::pin(da);
#pragma unroll
    for (int i = 0; i < 32; ++i) {
      const int r = row_of(i), s = wg::acc_col(i);
      float n = 0.f, a_term = 0.f;
      if (s < r) {
        const float d_a = -da[i], e = __expf(c.g[r] - c.g[s]);
        const float db = d_a * kk[i] * e;
        if (upper_row(i)) hi += db; else lo += db;
        n = d_a * c.beta[r] * e;
        a_term = c.beta[r] * db;  // dA_rs A_rs
      }
      da[i] = n;
      kk[i] = a_term;
    }
    store_row_sums(lo, hi, c.a_rows);
    store_column_sums(kk, c.a_cols);
    wg::store_accumulator(c.n, 0, 0, da);
  }
  barrier();  // phase 4
}

// Group 1: dq = exp(G) . dO' S^T + M K; then dbeta and dG per row.
template <typename T, int D>
__device__ void query_group(const Chunk<T, D>& c, const GatedDeltaArgs& p) {
  float acc[D / 2], lo = 0.f, hi = 0.f;
  wg::fence();
  wg::product<T, D, D>(acc, c.d_out, 0, 0, c.st, 0, 0, false);  // dO S^T
  wg::wait<0>();
  wg::pin(acc);
  row_dots(c.q, 0, acc, lo, hi);
  store_row_sums(lo, hi, c.q_dots);
  const float f_lo = c.decay[row_of(0)], f_hi = c.decay[row_of(2)];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) acc[i] *= upper_row(i) ? f_hi : f_lo;
  barrier();  // phase 2: M is in shared memory; it is causal, so depth up to the strip's last row.
  c.stream_wy_operands(p);
  wg::strip_product<T, false, false, D / 16>(acc, 0, c.m, c.strip, c.k, 0, 0, c.strip + 16);
  store_global_rows<T>(c.token_row0(p.dq, p), p.heads * D, c.at.valid, 0, acc);
  c.await_wy_operands();
  barrier();  // phase 3
  barrier();  // phase 4: every row sum is in; dbeta and dG, a row per thread of two warps.
  if (threadIdx.x % 128 < kC) {
    const int r = threadIdx.x % 128;
    auto sum4 = [&](const float* x) { return x[r] + x[kC + r] + x[2 * kC + r] + x[3 * kC + r]; };
    const float xk = c.beta[r] * c.gate[r];
    const float dbeta = c.gate[r] * c.xk_dots[r] + c.xv_dots[r] + c.xv_dots[kC + r] + c.a_rows[r];
    c.dg_sum[r] = c.score_rows[r] - sum4(c.score_cols) + c.decay[r] * c.q_dots[r] -
                  c.to_end[r] * c.k_dots[r] + xk * c.xk_dots[r] + c.beta[r] * c.a_rows[r] -
                  sum4(c.a_cols);
    if (r < c.at.valid) p.dbeta[c.at.token(r, 1, p.heads, p.tokens)] = dbeta;
  }
}

// Group 2: dk' = exp(G_C - G) . u dS^T + M^T Q + diag(beta exp(G)) dX_K + N K + N^T K, kept in
// registers from the first phase to the store.
template <typename T, int D>
__device__ void key_group(const Chunk<T, D>& c, const GatedDeltaArgs& p) {
  float acc[D / 2], lo = 0.f, hi = 0.f;
  wg::fence();
  wg::product<T, D, D>(acc, c.u, 0, 0, c.ds, 0, 0, false);  // u dS^T
  wg::wait<0>();
  wg::pin(acc);
  row_dots(c.k, 0, acc, lo, hi);
  store_row_sums(lo, hi, c.k_dots);
  {
    const float f_lo = c.to_end[row_of(0)], f_hi = c.to_end[row_of(2)];
#pragma unroll
    for (int i = 0; i < D / 2; ++i) acc[i] *= upper_row(i) ? f_hi : f_lo;
  }
  barrier();  // phase 2
  c.stream_wy_operands(p);
  // M^T Q (M^T's row s has r >= s).
  wg::strip_product<T, true, false, D / 16>(acc, 0, c.m, c.strip, c.q, 0, c.strip, kC);
  // dX_K = T^T dW, 32 columns at a time: into dk', its row dots, the element type for dA.
  {
    const float f_lo = c.beta[row_of(0)] * c.gate[row_of(0)];
    const float f_hi = c.beta[row_of(2)] * c.gate[row_of(2)];
    lo = hi = 0.f;
#pragma unroll
    for (int c0 = 0; c0 < D; c0 += 32) {
      float x[16];
      zero(x);
      wg::strip_product<T, true, false, 2>(x, 0, c.t, c.strip, c.dw, c0, c.strip, kC);
      row_dots(c.k, c0, x, lo, hi);
#pragma unroll
      for (int i = 0; i < 16; ++i) acc[(c0 / 8) * 4 + i] += (upper_row(i) ? f_hi : f_lo) * x[i];
      wg::store_accumulator(c.dxk, 0, c0, x);
    }
    store_row_sums(lo, hi, c.xk_dots);
  }
  c.await_wy_operands();
  barrier();  // phase 3
  barrier();  // phase 4: N K (N's row r has s < r) + N^T K (N^T's row s has r > s); then dk.
  wg::strip_product<T, false, false, D / 16>(acc, 0, c.n, c.strip, c.k, 0, 0, c.strip + 16);
  wg::strip_product<T, true, false, D / 16>(acc, 0, c.n, c.strip, c.k, 0, c.strip, kC);
  store_global_rows<T>(c.token_row0(p.dk, p), p.heads * D, c.at.valid, 0, acc);
}

// Group 3: dW = -du S^T and sum(S_i . dS_{i+1}); then the second half of dX_V.
template <typename T, int D>
__device__ void state_group(const Chunk<T, D>& c, const GatedDeltaArgs& p) {
  {
    float acc[D / 2];
    wg::fence();
    wg::product<T, D, D>(acc, c.du, 0, 0, c.st, 0, 0, false);  // du S^T
    // sum(S_i . dS_{i+1}) meanwhile, 8 elements per access (both tiles have the same layout).
    float dot = 0.f;
    for (int e = (threadIdx.x % 128) * 8; e < D * D; e += 128 * 8) {
      float a8[8], b8[8];
      load_pack<T, 8>(c.st.p + e, a8);
      load_pack<T, 8>(c.ds.p + e, b8);
#pragma unroll
      for (int j = 0; j < 8; ++j) dot += a8[j] * b8[j];
    }
    dot = warp_sum(dot);
    if (threadIdx.x % 32 == 0) c.state_part[(threadIdx.x / 32) % 4] = dot;
    wg::wait<0>();
    wg::pin(acc);
    wg::store_accumulator(c.dw, 0, 0, acc, -1.f);
  }
  barrier();  // phase 2
  c.stream_wy_operands(p);
  value_gradient_half<T, D>(c, p, 1);
  c.await_wy_operands();
  barrier();  // phase 3
  barrier();  // phase 4
}

template <typename T, int D>
__global__ void __launch_bounds__(kThreads, 1) chunk_grads_kernel(GatedDeltaArgs p) {
  extern __shared__ __align__(128) unsigned char raw[];
  const Chunk<T, D> c(raw, p);
  const ChunkPosition& at = c.at;
  const int token_stride = p.heads * D;
  auto token_rows = [&](const void* base) {
    return static_cast<const T*>(base) + at.token(0, D, p.heads, p.tokens);
  };
  wg::copy_rows_async<T, kC, D, kThreads>(c.q, token_rows(p.q), token_stride, at.valid);
  wg::copy_rows_async<T, kC, D, kThreads>(c.k, token_rows(p.k), token_stride, at.valid);
  wg::copy_rows_async<T, kC, D, kThreads>(c.d_out, token_rows(p.d_out), token_stride, at.valid);
  wg::copy_rows_async<T, kC, D, kThreads>(c.v, token_rows(p.v), token_stride, at.valid);
  wg::copy_rows_async<T, kC, D, kThreads>(c.u, c.chunk_row0(p.u), D, kC);
  wg::copy_rows_async<T, kC, D, kThreads>(c.du, c.chunk_row0(p.du), D, kC);
  wg::copy_rows_async<T, D, D, kThreads>(c.st, static_cast<const T*>(p.states) + at.state(D), D,
                                         D);
  wg::copy_rows_async<T, D, D, kThreads>(c.ds, static_cast<const T*>(p.state_grads) + at.state(D),
                                         D, D);
  wg::copy_rows_async<T, kC, kC, kThreads>(c.t, static_cast<const T*>(p.t_inverse) + at.tile(0, kC),
                                           kC, kC);
  if (threadIdx.x < kC) {
    const int r = threadIdx.x;
    const float* sums = p.gate_sums + (static_cast<int64_t>(at.bh) * at.chunks + at.chunk) * kC;
    const float g = sums[r], e = __expf(g);
    c.g[r] = g;
    c.gate[r] = e;
    c.decay[r] = p.scale * e;
    c.to_end[r] = __expf(sums[kC - 1] - g);
    c.beta[r] = r < at.valid ? p.beta[at.token(r, 1, p.heads, p.tokens)] : 0.f;
  }
  finish_loads();
  wg::fence_shared_for_mma();
  __syncthreads();
  // Each group runs its phases; the phases meet at barriers (see the top of the file).
  const int group = threadIdx.x / 128;
  if (group == 0) {
    scores_and_wy_group<T, D>(c, p);
  } else if (group == 1) {
    query_group<T, D>(c, p);
  } else if (group == 2) {
    key_group<T, D>(c, p);
  } else {
    state_group<T, D>(c, p);
  }
  __syncthreads();
  if (threadIdx.x < 32) {
    if (threadIdx.x == 0) {
      // The last row's key and state terms (G_C enters exp(G_C - G) and the state decay).
      float k_terms = 0.f;
      for (int r = 0; r < kC; ++r) k_terms += c.to_end[r] * c.k_dots[r];
      const float state_dot = c.state_part[0] + c.state_part[1] + c.state_part[2] + c.state_part[3];
      c.dg_sum[kC - 1] += k_terms + c.gate[kC - 1] * state_dot;
    }
    __syncwarp();
    warp_reverse_running_sum64(c.dg_sum);
    __syncwarp();
    for (int r = threadIdx.x; r < at.valid; r += 32) {
      p.dgate[at.token(r, 1, p.heads, p.tokens)] = c.dg_sum[r];
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
