// Per-chunk gradients of the fused gated DeltaNet, in one pass after the states' backward pass.
// With dO' = scale dO, P = (Q K^T) . D, the chunk's u and du (the total gradient of u), S_i and
// the gradient dS_{i+1} of the state leaving the chunk:
//   chunk part:  dP^ = dO' u^T;  M = dP^ . D  (the gradient of the raw scores Q K^T)
//                dq  = exp(G) . (dO' S_i^T) + M K
//                dk' = M^T Q + exp(G_C - G) . (u dS_{i+1}^T)
//                dW  = -du S_i^T
//                dG' = rowsum(dP^ . P) - colsum(dP^ . P) + exp(G) . rowsum(Q . (dO' S_i^T))
//                      - exp(G_C - G) . rowsum(K . (u dS^T)), and at r = C - 1 (G_C) also
//                      sum(exp(G_C - G) . rowsum(K . (u dS^T))) + exp(G_C) sum(S_i . dS_{i+1});
//   WY part (the backward of [W | U0] = T X, X = [diag(beta exp(G)) K | diag(beta) V],
//   T = (I + A)^-1 from the prepare pass, E_rs = exp(G_r - G_s), N = dA . beta_r E):
//                dX = T^T [dW | du],
//                dA = -dX [W | U0]^T = -(dX_K K^T diag(beta exp(G)) + dX_V V^T diag(beta)) T^T
//                     (strictly lower; W and U0 are not read)
//                dk = dk' + diag(beta exp(G)) dX_K + N K + N^T K,   dv = diag(beta) dX_V
//                dbeta_r = exp(G_r) k_r . dX_K[r] + v_r . dX_V[r] + sum_s dA_rs (k_r . k_s) E_rs
//                dG_r   += beta_r exp(G_r) k_r . dX_K[r] + sum_s dA_rs A_rs - sum_s dA_sr A_sr
//   and dg is the reverse running sum of dG inside the chunk (g_t enters every G_r, r >= t).
//
// Four warpgroups. Every product with a 64-row result whose operands are K-major (Q K^T, dO u^T,
// K K^T, dO S^T, u dS^T, du S^T, dX_K K^T, dX_V V^T) is one group's wgmma from shared memory,
// its 64 x N result in that group's registers, where the row and column sums, decays and
// scalings are applied. The products with a transposed operand (M K, M^T Q, T^T dW, T^T du,
// (.) T^T, N K, N^T K; depth 64, triangular) continue on the same registers with each warp's
// mma.sync over its 16 rows, skipping the blocks the triangle zeroes. Only M, dW, dX and N go
// through shared memory, as operands in the element type; dk' stays in one group's registers
// from the first phase to the store.
//   phase 1: group 0 P, dP^ -> M and the score sums; group 1 dO S^T; group 2 u dS^T -> dk';
//            group 3 dW, sum(S_i . dS).
//   phase 2: group 1 dq; group 2 dk' += M^T Q, dX_K; groups 0 and 3 dX_V, dv (column halves).
//   phase 3: group 0 K K^T and dA -> N, its sums.
//   phase 4: group 2 dk' += N K + N^T K, dk; group 1 dbeta and dG per row.
// Persistent CTAs (one per SM) walk the chunks; each input tile of the next chunk is copied in as
// soon as the phase that last reads it is over (K is double-buffered), so the loads overlap the
// current chunk's products. A pass that runs beside a pipelined walk (a chunk range) takes one
// chunk per CTA instead, leaving the walk its SMs.
#include <algorithm>
#include <cstdlib>

#include "common/device_info.h"
#include "common/tensor_copy.cuh"
#include "common/tensor_map.h"
#include "common/warpgroup_mma.cuh"
#include "gated_delta/chunk_passes.h"
#include "gated_delta/chunk_tiles.cuh"

namespace mhla_kernels {
namespace gated_delta {
namespace {

namespace wg = warpgroup;
using wg::CoreTile;

constexpr int kThreads = 512;

// Shared memory (bytes): element-type core tiles, then per-row fp32 arrays. dX_K and dX_V take
// S_i's place at D = 128 (S_i is done with after phase 1; its next copy waits for phase 3), their
// own at D = 64; N takes M's. K has two places: the next chunk's copy goes in after phase 1.
template <int D>
struct GradsLayout {
  static constexpr size_t tile = 2 * kC * D;     // [64][D]
  static constexpr size_t state = 2 * D * D;     // [D][D]
  static constexpr size_t square = 2 * kC * kC;  // [64][64]
  static constexpr bool dx_over_state = 2 * tile <= state;
  static constexpr size_t k0 = 0, k1 = k0 + tile, q = k1 + tile, d_out = q + tile, u = d_out + tile,
                          du = u + tile, v = du + tile, st = v + tile, ds = st + state,
                          t = ds + state, m = t + square, dw = m + square, dx_own = dw + tile,
                          rows = dx_own + (dx_over_state ? 0 : 2 * tile);
  static constexpr size_t dxk = dx_over_state ? st : dx_own, dxv = dxk + tile, n = m;
  static constexpr int kRowArrays = 26;  // per-row arrays of 64 floats (see Chunk)
  static constexpr size_t barriers = rows + 4 * kRowArrays * kC;  // 3 mbarriers, 8-byte aligned
  static constexpr size_t bytes = barriers + 3 * 8;
};

// Per-thread view of the two rows a thread's accumulator elements lie on.
__device__ __forceinline__ int row_of(int i) {
  return wg::acc_row(i);
}
__device__ __forceinline__ bool upper_row(int i) {
  return (i % 4) >= 2;
}

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
template <typename Tile, int R>
__device__ __forceinline__ void row_dots(Tile x, int c0, const float (&acc)[R], float& lo,
                                         float& hi) {
#pragma unroll
  for (int i = 0; i < R; i += 2) {
    const auto pair = *reinterpret_cast<const typename std::conditional_t<
        std::is_same_v<typename Tile::elem, __nv_bfloat16>, __nv_bfloat162, __half2>*>(
        x.at(row_of(i), c0 + wg::acc_col(i)));
    const float d = to_float(pair.x) * acc[i] + to_float(pair.y) * acc[i + 1];
    if (upper_row(i))
      hi += d;
    else
      lo += d;
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

// Asynchronous 4-byte copy global -> shared (zero-filled when !valid).
__device__ __forceinline__ void copy_async4(float* dst, const float* src, bool valid) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(s), "l"(src),
               "r"(valid ? 4 : 0));
}

// The kernel's barriers: every thread passes each once per chunk, from its group's code.
__device__ __forceinline__ void barrier() {
  asm volatile("bar.sync 0;\n" ::: "memory");
}

// The tensor maps of the inputs a chunk reads (tensor_map.h): boxes of 64 token rows (q, k, dO,
// v), of one chunk's 64 rows (u, du, T) and of one chunk's D rows (S_i, dS_{i+1}).
struct GradsMaps {
  CUtensorMap q, k, d_out, v, u, du, t_inverse, states, state_grads;
};

// The shared tiles, the per-row arrays and the chunk a CTA is on; the copies of each chunk's
// inputs, issued phase by phase for the next chunk.
template <typename T, int D>
struct Chunk {
  using L = GradsLayout<D>;
  unsigned char* raw;
  // The tiles and row arrays, as offsets from `raw` (no pointers held in registers).
  __device__ CoreTile<T, D> tile(size_t offset) const {
    return CoreTile<T, D>{reinterpret_cast<T*>(raw + offset)};
  }
  __device__ CoreTile<T, kC> square(size_t offset) const {
    return CoreTile<T, kC>{reinterpret_cast<T*>(raw + offset)};
  }
  __device__ float* rows(int index) const {
    return reinterpret_cast<float*>(raw + L::rows) + index * kC;
  }
  // Tiles the tensor copies fill: column blocks major (CoreTile's Rows).
  using Rows64 = CoreTile<T, D, kC>;
  using State = CoreTile<T, D, D>;
  __device__ Rows64 copied(size_t offset) const {
    return Rows64{reinterpret_cast<T*>(raw + offset)};
  }
  __device__ Rows64 q() const { return copied(L::q); }
  __device__ Rows64 d_out() const { return copied(L::d_out); }
  __device__ Rows64 u() const { return copied(L::u); }
  __device__ Rows64 du() const { return copied(L::du); }
  __device__ Rows64 v() const { return copied(L::v); }
  __device__ State st() const { return State{reinterpret_cast<T*>(raw + L::st)}; }
  __device__ State ds() const { return State{reinterpret_cast<T*>(raw + L::ds)}; }
  __device__ CoreTile<T, D> dw() const { return tile(L::dw); }
  __device__ CoreTile<T, D> dxk() const { return tile(L::dxk); }
  __device__ CoreTile<T, D> dxv() const { return tile(L::dxv); }
  __device__ CoreTile<T, kC, kC> t() const {
    return CoreTile<T, kC, kC>{reinterpret_cast<T*>(raw + L::t)};
  }
  __device__ CoreTile<T, kC> m() const { return square(L::m); }
  __device__ CoreTile<T, kC> n() const { return square(L::n); }
  __device__ float* g_buf() const { return rows(0); }        // [2][64]: G, this chunk and next
  __device__ float* beta_buf() const { return rows(2); }     // [2][64]
  __device__ float* gate() const { return rows(4); }         // exp(G)
  __device__ float* decay() const { return rows(5); }        // scale exp(G)
  __device__ float* to_end() const { return rows(6); }       // exp(G_C - G)
  __device__ float* score_rows() const { return rows(7); }   // rowsum(dP^ . P)
  __device__ float* score_cols() const { return rows(8); }   // [4][64]: colsum, per warp
  __device__ float* q_dots() const { return rows(12); }      // rowsum(Q . dO S^T)
  __device__ float* k_dots() const { return rows(13); }      // rowsum(K . u dS^T)
  __device__ float* xk_dots() const { return rows(14); }     // k_r . dX_K[r]
  __device__ float* xv_dots() const { return rows(15); }     // [2][64]: v_r . dX_V[r]
  __device__ float* a_rows() const { return rows(17); }      // sum_s dA_rs (k_r . k_s) E_rs
  __device__ float* a_cols() const { return rows(18); }      // [4][64]: sum_r dA_rs A_rs
  __device__ float* dg_sum() const { return rows(22); }      // dG, then its reverse sum
  __device__ float* state_part() const { return rows(23); }  // [4]: sum(S_i . dS) per warp
  int item, items, range, parity;  // work item (chunk of the range x batch-head), K's buffer
  int count = 0;                   // chunks this CTA has begun (the barriers' phase)
  ChunkPosition at;

  __device__ static ChunkPosition position(const GatedDeltaArgs& p, int item, int range) {
    return ChunkPosition(p, item / range, p.chunk_begin + item % range);
  }
  __device__ Chunk(unsigned char* raw_, const GatedDeltaArgs& p)
      : raw(raw_), item(blockIdx.x), parity(0), at(p, 0, p.chunk_begin) {
    range = range_end(p) - p.chunk_begin;
    items = range * p.batch * p.heads;
    at = position(p, item, range);
  }
  __device__ Rows64 k() const { return copied(parity ? L::k1 : L::k0); }
  __device__ uint64_t* bar(int stage) const {
    return reinterpret_cast<uint64_t*>(raw + L::barriers) + (stage - 1);
  }
  __device__ const float* g() const { return g_buf() + parity * kC; }
  __device__ const float* beta() const { return beta_buf() + parity * kC; }
  // The warp's first row in its group's 64 x N results.
  __device__ static int strip() { return 16 * ((threadIdx.x / 32) % 4); }
  __device__ bool valid() const { return item < items; }
  // The next item: its position too, which the stores of dq, dk, dv, dbeta and dg address (until
  // session 17 `at` stayed on the first item, so a CTA's later chunks overwrote its first one's
  // gradients and theirs were never written).
  __device__ void advance(const GatedDeltaArgs& p) {
    item += gridDim.x;
    parity ^= 1;
    ++count;
    at = position(p, item, range);
  }
  __device__ T* out_rows(void* base, const GatedDeltaArgs& p) const {
    return static_cast<T*>(base) + at.token(0, D, p.heads, p.tokens);
  }

  // ---- Copies of chunk `next` (this CTA's next item), each into a place the current chunk is
  // done with, started by one thread of group 3 (light in phases 2 to 4): stage 1 after phase 1
  // (K into its other place, dO, u, dS), stage 2 after phase 2 (q, du), stage 3 after phase 3
  // (v, S_i, T, and G and beta by cp.async from group 3's first two warps). Stage s completes
  // on barrier s; stage 0 is all three, for the first chunk.
  static constexpr int kIssuer = 3 * 128;
  __device__ void copy_stage(const GatedDeltaArgs& p, const GradsMaps& maps, int stage,
                             int next_item, int buffer) const {
    if (next_item >= items) return;
    const ChunkPosition nx = position(p, next_item, range);
    const int tile_row =
        static_cast<int>((static_cast<int64_t>(nx.bh) * nx.chunks + nx.chunk) * kC);
    const int state_row =
        static_cast<int>((static_cast<int64_t>(nx.bh) * nx.chunks + nx.chunk) * D);
    if (threadIdx.x == kIssuer) {
      namespace tc = tensor_copy;
      if (stage == 0 || stage == 1) {
        tc::arrive_expecting(bar(1), 3 * L::tile + L::state);
        tc::copy_token_rows(raw + (buffer ? L::k1 : L::k0), &maps.k, nx.t0, nx.h, nx.b, bar(1));
        tc::copy_token_rows(raw + L::d_out, &maps.d_out, nx.t0, nx.h, nx.b, bar(1));
        tc::copy_matrix_rows(raw + L::u, &maps.u, tile_row, bar(1));
        tc::copy_matrix_rows(raw + L::ds, &maps.state_grads, state_row, bar(1));
      }
      if (stage == 0 || stage == 2) {
        tc::arrive_expecting(bar(2), 2 * L::tile);
        tc::copy_token_rows(raw + L::q, &maps.q, nx.t0, nx.h, nx.b, bar(2));
        tc::copy_matrix_rows(raw + L::du, &maps.du, tile_row, bar(2));
      }
      if (stage == 0 || stage == 3) {
        tc::arrive_expecting(bar(3), L::tile + L::state + L::square);
        tc::copy_token_rows(raw + L::v, &maps.v, nx.t0, nx.h, nx.b, bar(3));
        tc::copy_matrix_rows(raw + L::st, &maps.states, state_row, bar(3));
        tc::copy_matrix_rows(raw + L::t, &maps.t_inverse, tile_row, bar(3));
      }
    }
    if ((stage == 0 || stage == 3) && threadIdx.x >= kIssuer && threadIdx.x < kIssuer + kC) {
      const int r = threadIdx.x - kIssuer;
      const float* sums = p.gate_sums + static_cast<int64_t>(tile_row);
      copy_async4(g_buf() + buffer * kC + r, sums + r, true);
      copy_async4(beta_buf() + buffer * kC + r,
                  p.beta + (r < nx.valid ? nx.token(r, 1, p.heads, p.tokens) : 0), r < nx.valid);
      copy_async_commit();
    }
  }
  // After phase `phase` of the current chunk: the next chunk's inputs that were read last then.
  __device__ void prefetch(const GatedDeltaArgs& p, const GradsMaps& maps, int phase) const {
    copy_stage(p, maps, phase, item + gridDim.x, parity ^ 1);
  }
  // The start of a chunk: its copies are in.
  __device__ void begin() const {
    const uint32_t phase = count & 1;
    tensor_copy::wait(bar(1), phase);
    tensor_copy::wait(bar(2), phase);
    tensor_copy::wait(bar(3), phase);
    copy_async_wait<0>();  // G and beta (group 3's first two warps)
    barrier();
  }
  // The chunk's row factors, by group 0's first two warps during phase 1 (read from phase 2 on).
  __device__ void row_factors(const GatedDeltaArgs& p) const {
    if (threadIdx.x < kC) {
      const int r = threadIdx.x;
      const float e = __expf(g()[r]);
      gate()[r] = e;
      decay()[r] = p.scale * e;
      to_end()[r] = __expf(g()[kC - 1] - g()[r]);
    }
  }
};
static_assert(GradsLayout<64>::kRowArrays >= 24, "the last row array (state_part, index 23) fits");

// Groups 0 and 3: dX_V = T^T du for half of the columns (T^T's row s has r >= s): dv, the row
// dots with v, and the element type for dA.
template <typename T, int D>
__device__ void value_gradient_half(const Chunk<T, D>& c, const GatedDeltaArgs& p, int half) {
  constexpr int kHalf = D / 2;
  float x[kHalf / 2], lo = 0.f, hi = 0.f;
  zero(x);
  wg::strip_product<T, true, false, kHalf / 16>(x, 0, c.t(), c.strip(), c.du(), half * kHalf,
                                                c.strip(), kC);
  row_dots(c.v(), half * kHalf, x, lo, hi);
  store_row_sums(lo, hi, c.xv_dots() + half * kC);
  wg::store_accumulator(c.dxv(), 0, half * kHalf, x);
  const float b_lo = c.beta()[row_of(0)], b_hi = c.beta()[row_of(2)];
#pragma unroll
  for (int i = 0; i < kHalf / 2; ++i) x[i] *= upper_row(i) ? b_hi : b_lo;
  store_global_rows<T>(c.out_rows(p.dv, p), p.heads * D, c.at.valid, half * kHalf, x);
}

// Group 0: the scores (M and the score sums); half of dX_V; K K^T and dA (N and its sums); and
// after the last phase the reverse running sum of dG, dg.
template <typename T, int D>
__device__ void scores_and_wy_group(Chunk<T, D>& c, const GatedDeltaArgs& p,
                                    const GradsMaps& maps) {
  for (; c.valid(); c.advance(p)) {
    c.begin();
    c.row_factors(p);
    const float* g = c.g();
    {
      float scores[32], dscores[32], lo = 0.f, hi = 0.f;
      wg::fence();
      wg::product<T, kC, D>(scores, c.q(), 0, 0, c.k(), 0, 0, false);
      wg::product<T, kC, D>(dscores, c.d_out(), 0, 0, c.u(), 0, 0, false);
      wg::wait<0>();
      wg::pin(scores);
      wg::pin(dscores);
      // t = dP^ . P . D (for the gate sums) and M = dP^ . D, causal.
#pragma unroll
      for (int i = 0; i < 32; ++i) {
        const int r = row_of(i), s = wg::acc_col(i);
        float t = 0.f, mv = 0.f;
        if (s <= r) {
          const float d = __expf(g[r] - g[s]), dp = p.scale * dscores[i];
          t = dp * scores[i] * d;
          mv = dp * d;
        }
        scores[i] = t;
        dscores[i] = mv;
        if (upper_row(i))
          hi += t;
        else
          lo += t;
      }
      store_row_sums(lo, hi, c.score_rows());
      store_column_sums(scores, c.score_cols());
      wg::store_accumulator(c.m(), 0, 0, dscores);
    }
    barrier();  // phase 2
    c.prefetch(p, maps, 1);
    value_gradient_half<T, D>(c, p, 0);
    wg::fence_shared_for_mma();
    barrier();  // phase 3
    c.prefetch(p, maps, 2);
    {
      // dA = -(dX_K K^T diag(beta exp(G)) + dX_V V^T diag(beta)) T^T beside K K^T.
      float kk[32], y[32], lo = 0.f, hi = 0.f;
      wg::fence();
      wg::product<T, kC, D>(y, c.dxk(), 0, 0, c.k(), 0, 0, false);
      wg::product<T, kC, D>(kk, c.dxv(), 0, 0, c.v(), 0, 0, false);
      wg::wait<0>();
      wg::pin(y);
      wg::pin(kk);
#pragma unroll
      for (int i = 0; i < 32; ++i) {
        const int j = wg::acc_col(i);
        const float b = c.beta()[j];
        y[i] = y[i] * b * c.gate()[j] + kk[i] * b;
      }
      unsigned frag[4][4];
      wg::to_a_fragments<T>(y, frag);
      wg::fence();
      wg::product<T, kC, D>(kk, c.k(), 0, 0, c.k(), 0, 0, false);  // K K^T, while dA forms
      float da[32];
      zero(da);
      wg::strip_product_from_registers<T, true, kC / 16>(da, 0, frag, c.t(), 0, 0, kC);
      wg::wait<0>();
      wg::pin(kk);
#pragma unroll
      for (int i = 0; i < 32; ++i) {
        const int r = row_of(i), s = wg::acc_col(i);
        float nv = 0.f, a_term = 0.f;
        if (s < r) {
          const float d_a = -da[i], e = __expf(g[r] - g[s]);
          const float db = d_a * kk[i] * e;
          if (upper_row(i))
            hi += db;
          else
            lo += db;
          nv = d_a * c.beta()[r] * e;
          a_term = c.beta()[r] * db;  // dA_rs A_rs
        }
        da[i] = nv;
        kk[i] = a_term;
      }
      store_row_sums(lo, hi, c.a_rows());
      store_column_sums(kk, c.a_cols());
      wg::store_accumulator(c.n(), 0, 0, da);
    }
    barrier();  // phase 4
    c.prefetch(p, maps, 3);
    barrier();  // the row values of dG are in (group 1)
    if (threadIdx.x < 32) {
      // The last row's key and state terms (G_C enters exp(G_C - G) and the state decay), summed
      // by the warp (one thread's loop over the 64 rows sat on the chunk's critical path).
      const int lane = threadIdx.x;
      const float k_terms = warp_sum(c.to_end()[lane] * c.k_dots()[lane] +
                                     c.to_end()[lane + 32] * c.k_dots()[lane + 32]);
      if (lane == 0) {
        const float state_dot =
            c.state_part()[0] + c.state_part()[1] + c.state_part()[2] + c.state_part()[3];
        c.dg_sum()[kC - 1] += k_terms + c.gate()[kC - 1] * state_dot;
      }
      __syncwarp();
      warp_reverse_running_sum64(c.dg_sum());
      __syncwarp();
      for (int r = threadIdx.x; r < c.at.valid; r += 32) {
        p.dgate[c.at.token(r, 1, p.heads, p.tokens)] = c.dg_sum()[r];
      }
    }
  }
}

// Group 1: dq = exp(G) . dO' S^T + M K; then dbeta and dG per row.
template <typename T, int D>
__device__ void query_group(Chunk<T, D>& c, const GatedDeltaArgs& p, const GradsMaps& maps) {
  for (; c.valid(); c.advance(p)) {
    c.begin();
    float acc[D / 2], lo = 0.f, hi = 0.f;
    wg::fence();
    wg::product<T, D, D>(acc, c.d_out(), 0, 0, c.st(), 0, 0, false);  // dO S^T
    wg::wait<0>();
    wg::pin(acc);
    row_dots(c.q(), 0, acc, lo, hi);
    store_row_sums(lo, hi, c.q_dots());
    const float* g = c.g();
    const float f_lo = p.scale * __expf(g[row_of(0)]), f_hi = p.scale * __expf(g[row_of(2)]);
#pragma unroll
    for (int i = 0; i < D / 2; ++i) acc[i] *= upper_row(i) ? f_hi : f_lo;
    barrier();  // phase 2: M is in; it is causal, so depth up to the strip's last row.
    c.prefetch(p, maps, 1);
    wg::strip_product<T, false, false, D / 16>(acc, 0, c.m(), c.strip(), c.k(), 0, 0,
                                               c.strip() + 16);
    store_global_rows<T>(c.out_rows(p.dq, p), p.heads * D, c.at.valid, 0, acc);
    barrier();  // phase 3
    c.prefetch(p, maps, 2);
    barrier();  // phase 4: every row sum is in; dbeta and dG, a row per thread of two warps.
    c.prefetch(p, maps, 3);
    if (threadIdx.x % 128 < kC) {
      const int r = threadIdx.x % 128;
      auto sum4 = [&](const float* x) { return x[r] + x[kC + r] + x[2 * kC + r] + x[3 * kC + r]; };
      const float beta = c.beta()[r], xk = beta * c.gate()[r];
      const float dbeta =
          c.gate()[r] * c.xk_dots()[r] + c.xv_dots()[r] + c.xv_dots()[kC + r] + c.a_rows()[r];
      c.dg_sum()[r] = c.score_rows()[r] - sum4(c.score_cols()) + c.decay()[r] * c.q_dots()[r] -
                      c.to_end()[r] * c.k_dots()[r] + xk * c.xk_dots()[r] + beta * c.a_rows()[r] -
                      sum4(c.a_cols());
      if (r < c.at.valid) p.dbeta[c.at.token(r, 1, p.heads, p.tokens)] = dbeta;
    }
    barrier();  // dG's row values are in
  }
}

// Group 2: dk' = exp(G_C - G) . u dS^T + M^T Q + diag(beta exp(G)) dX_K + N K + N^T K, kept in
// registers from the first phase to the store.
template <typename T, int D>
__device__ void key_group(Chunk<T, D>& c, const GatedDeltaArgs& p, const GradsMaps& maps) {
  for (; c.valid(); c.advance(p)) {
    c.begin();
    float acc[D / 2], lo = 0.f, hi = 0.f;
    wg::fence();
    wg::product<T, D, D>(acc, c.u(), 0, 0, c.ds(), 0, 0, false);  // u dS^T
    wg::wait<0>();
    wg::pin(acc);
    row_dots(c.k(), 0, acc, lo, hi);
    store_row_sums(lo, hi, c.k_dots());
    {
      const float* g = c.g();
      const float f_lo = __expf(g[kC - 1] - g[row_of(0)]), f_hi = __expf(g[kC - 1] - g[row_of(2)]);
#pragma unroll
      for (int i = 0; i < D / 2; ++i) acc[i] *= upper_row(i) ? f_hi : f_lo;
    }
    barrier();  // phase 2
    c.prefetch(p, maps, 1);
    // M^T Q (M^T's row s has r >= s).
    wg::strip_product<T, true, false, D / 16>(acc, 0, c.m(), c.strip(), c.q(), 0, c.strip(), kC);
    // dX_K = T^T dW, 32 columns at a time: into dk', its row dots, the element type for dA.
    {
      const float f_lo = c.beta()[row_of(0)] * c.gate()[row_of(0)];
      const float f_hi = c.beta()[row_of(2)] * c.gate()[row_of(2)];
      lo = hi = 0.f;
#pragma unroll
      for (int c0 = 0; c0 < D; c0 += 32) {
        float x[16];
        zero(x);
        wg::strip_product<T, true, false, 2>(x, 0, c.t(), c.strip(), c.dw(), c0, c.strip(), kC);
        row_dots(c.k(), c0, x, lo, hi);
#pragma unroll
        for (int i = 0; i < 16; ++i) acc[(c0 / 8) * 4 + i] += (upper_row(i) ? f_hi : f_lo) * x[i];
        wg::store_accumulator(c.dxk(), 0, c0, x);
      }
      store_row_sums(lo, hi, c.xk_dots());
    }
    wg::fence_shared_for_mma();
    barrier();  // phase 3
    c.prefetch(p, maps, 2);
    barrier();  // phase 4: N K (N's row r has s < r) + N^T K (N^T's row s has r > s); then dk.
    c.prefetch(p, maps, 3);
    wg::strip_product<T, false, false, D / 16>(acc, 0, c.n(), c.strip(), c.k(), 0, 0,
                                               c.strip() + 16);
    wg::strip_product<T, true, false, D / 16>(acc, 0, c.n(), c.strip(), c.k(), 0, c.strip(), kC);
    store_global_rows<T>(c.out_rows(p.dk, p), p.heads * D, c.at.valid, 0, acc);
    barrier();  // dG's row values are in
  }
}

// Group 3: dW = -du S^T and sum(S_i . dS_{i+1}); then the second half of dX_V.
template <typename T, int D>
__device__ void state_group(Chunk<T, D>& c, const GatedDeltaArgs& p, const GradsMaps& maps) {
  for (; c.valid(); c.advance(p)) {
    c.begin();
    {
      float acc[D / 2];
      wg::fence();
      wg::product<T, D, D>(acc, c.du(), 0, 0, c.st(), 0, 0, false);  // du S^T
      // sum(S_i . dS_{i+1}) meanwhile, 8 elements per access (both tiles have the same layout).
      float dot = 0.f;
      for (int e = (threadIdx.x % 128) * 8; e < D * D; e += 128 * 8) {
        float a8[8], b8[8];
        load_pack<T, 8>(c.st().p + e, a8);
        load_pack<T, 8>(c.ds().p + e, b8);
#pragma unroll
        for (int j = 0; j < 8; ++j) dot += a8[j] * b8[j];
      }
      dot = warp_sum(dot);
      if (threadIdx.x % 32 == 0) c.state_part()[(threadIdx.x / 32) % 4] = dot;
      wg::wait<0>();
      wg::pin(acc);
      wg::store_accumulator(c.dw(), 0, 0, acc, -1.f);
    }
    barrier();  // phase 2
    c.prefetch(p, maps, 1);
    value_gradient_half<T, D>(c, p, 1);
    wg::fence_shared_for_mma();
    barrier();  // phase 3
    c.prefetch(p, maps, 2);
    barrier();  // phase 4
    c.prefetch(p, maps, 3);
    barrier();  // dG's row values are in
  }
}

template <typename T, int D>
__global__ void __launch_bounds__(kThreads, 1)
    chunk_grads_kernel(GatedDeltaArgs p, const __grid_constant__ GradsMaps maps) {
  extern __shared__ __align__(128) unsigned char raw[];
  Chunk<T, D> c(raw, p);
  if (threadIdx.x == 0) {
    for (int s = 1; s <= 3; ++s) tensor_copy::init(c.bar(s));
    tensor_copy::fence_init();
  }
  __syncthreads();
  c.copy_stage(p, maps, 0, c.item, 0);  // the first chunk, whole
  const int group = threadIdx.x / 128;
  if (group == 0) {
    scores_and_wy_group<T, D>(c, p, maps);
  } else if (group == 1) {
    query_group<T, D>(c, p, maps);
  } else if (group == 2) {
    key_group<T, D>(c, p, maps);
  } else {
    state_group<T, D>(c, p, maps);
  }
}

template <typename T, int D>
struct ChunkGrads {
  static cudaError_t launch(const GatedDeltaArgs& a, cudaStream_t stream) {
    GradsMaps maps;
    const int chunks = gated_delta_chunks(a.tokens);
    const int64_t tile_rows = static_cast<int64_t>(a.batch) * a.heads * chunks * kC;
    const int64_t state_rows = static_cast<int64_t>(a.batch) * a.heads * chunks * D;
    cudaError_t err = cudaSuccess;
    auto token_map = [&](CUtensorMap* m, const void* base) {
      if (err == cudaSuccess) {
        err = encode_token_rows_map(m, base, a.batch, a.tokens, a.heads, D, kC);
      }
    };
    auto matrix_map = [&](CUtensorMap* m, const void* base, int64_t rows, int cols, int box) {
      if (err == cudaSuccess) err = encode_matrix_rows_map(m, base, rows, cols, box);
    };
    token_map(&maps.q, a.q);
    token_map(&maps.k, a.k);
    token_map(&maps.d_out, a.d_out);
    token_map(&maps.v, a.v);
    matrix_map(&maps.u, a.u, tile_rows, D, kC);
    matrix_map(&maps.du, a.du, tile_rows, D, kC);
    matrix_map(&maps.t_inverse, a.t_inverse, tile_rows, kC, kC);
    matrix_map(&maps.states, a.states, state_rows, D, D);
    matrix_map(&maps.state_grads, a.state_grads, state_rows, D, D);
    if (err != cudaSuccess) return err;
    const dim3 one_each = chunk_grid(a);
    const int items = static_cast<int>(one_each.x * one_each.y);
    // Persistent over the whole sequence; one chunk per CTA beside a pipelined walk.
    // MHLA_DELTA_GRADS_PERSISTENT=0 takes one chunk per CTA everywhere (the A/B of the two).
    const char* persistent = std::getenv("MHLA_DELTA_GRADS_PERSISTENT");
    const bool whole = a.chunk_begin == 0 && a.chunk_end == 0 &&
                       !(persistent != nullptr && persistent[0] == '0');
    const int grid = whole ? std::min(items, multiprocessors()) : items;
    const auto kernel = chunk_grads_kernel<T, D>;
    if (err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                   static_cast<int>(GradsLayout<D>::bytes));
        err != cudaSuccess) {
      return err;
    }
    kernel<<<grid, kThreads, GradsLayout<D>::bytes, stream>>>(a, maps);
    return cudaGetLastError();
  }
};

}  // namespace

cudaError_t run_chunk_grads(const GatedDeltaArgs& a, cudaStream_t stream) {
  return dispatch<ChunkGrads>(a, stream);
}

}  // namespace gated_delta
}  // namespace mhla_kernels
