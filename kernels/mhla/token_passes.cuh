#pragma once
// The token passes of the bidirectional block-linear kernels that keep their block states on chip
// (cluster_block_linear.cu): one span of tokens [begin, end) of one
// (batch, head), walked in 64-token tiles with the feature map applied while loading and the
// products on tensor cores (the helpers of tiles.cuh and state_tiles.cuh).
//   span_state   : S = phi(K)^T V and z = sum phi(k) over the span (fp32, D x D then D)
//   output_tiles : o = phi(Q) S' / (phi(Q) z' + eps)
//   query_tiles  : dq, and dS' += phi(Q)^T dO / den, dz' += phi(Q)^T dden (o recomputed)
//   key_tiles    : dk, dv from dS and dz
// Each pass finds its first tile's rows already in the registers it is given (issued by the
// caller, so that the loads fly across whatever came before), and calls `after_last` once the
// registers of its last tile are free, so the caller can issue the next pass's first tile.
#include "mhla/state_tiles.cuh"
#include "mhla/tiles.cuh"

namespace mhla_kernels {
namespace tiles {

// A token span of one (batch, head).
struct Span {
  int b, h, begin, end;
};

// The first tile of a span at token n0: rows of `x` into registers.
template <typename T, int D>
__device__ __forceinline__ void issue_rows(const TokenTensor& x, const Span& w, int n0,
                                           TileRows<T, D>& rows_of_x) {
  const int valid = min(kTile, w.end - n0), rows = (valid + 15) / 16 * 16;
  rows_of_x.load(x, w.b, w.h, n0, valid, rows);
}

// Per-column sums of a tile's rows by all threads: thread t adds column t % D of rows
// t / D, t / D + kThreads / D, ... to `partial`; column_sums() then folds the partials.
template <typename T, int D>
__device__ __forceinline__ void add_column(const typename Mma<T>::elem* tile, int valid,
                                           const float* row_weight, float& partial) {
  using L = Layout<T, D>;
  const int d = threadIdx.x % D;
  for (int r = threadIdx.x / D; r < valid; r += kThreads / D) {
    const float x = to_float(tile[r * L::lde + d]);
    partial += row_weight != nullptr ? x * row_weight[r] : x;
  }
}

// Column d's sum into out[d] for d < D (scratch: kThreads floats; ends with a CTA barrier).
template <int D>
__device__ __forceinline__ void column_sums(float partial, float* scratch, float* out) {
  scratch[threadIdx.x] = partial;
  __syncthreads();
  if (threadIdx.x < D) {
    float sum = 0.f;
#pragma unroll
    for (int g = 0; g < kThreads / D; ++g) sum += scratch[g * D + threadIdx.x];
    out[threadIdx.x] = sum;
  }
  __syncthreads();
}

// S = phi(K)^T V and z = sum phi(k) over the span, into `state` (fp32, D x D then D).
template <typename T, int D, typename AfterLast>
__device__ void span_state(const TokenTensor& k, const TokenTensor& v, const Span& w,
                           TileRows<T, D>& k_rows, TileRows<T, D>& v_rows,
                           typename Mma<T>::elem* kf, typename Mma<T>::elem* vt, float* state,
                           float* scratch, AfterLast after_last) {
  using L = Layout<T, D>;
  FragC<T> acc[L::frags_per_warp];
#pragma unroll
  for (int u = 0; u < L::frags_per_warp; ++u) wmma::fill_fragment(acc[u], 0.f);
  float z = 0.f;
  for (int n0 = w.begin; n0 < w.end; n0 += kTile) {
    const int valid = min(kTile, w.end - n0), rows = (valid + 15) / 16 * 16;
    __syncthreads();
    k_rows.store_features(valid, rows, kf, nullptr);
    v_rows.store_plain(rows, vt);
    if (n0 + kTile < w.end) {
      issue_rows<T, D>(k, w, n0 + kTile, k_rows);
      issue_rows<T, D>(v, w, n0 + kTile, v_rows);
    } else {
      after_last();
    }
    __syncthreads();
    add_column<T, D>(kf, valid, nullptr, z);
    accumulate_at_b<T, D>(acc, kf, vt, rows);
  }
  write_state<T, D>(acc, state, /*atomic=*/false, state);
  column_sums<D>(z, scratch, state + D * D);
}

// phi(q) . z' + eps for the valid rows of a feature tile, four threads per row.
template <typename T, int D>
__device__ __forceinline__ void denominators(const typename Mma<T>::elem* qf, const float* z,
                                             int valid, float* out) {
  using L = Layout<T, D>;
  static_assert(kThreads == 4 * kTile, "four threads per tile row");
  const int r = threadIdx.x / 4, part = threadIdx.x % 4;
  float dot = 0.f;
#pragma unroll 8
  for (int d = part * (D / 4); d < (part + 1) * (D / 4); ++d)
    dot += to_float(qf[r * L::lde + d]) * z[d];
  dot += __shfl_xor_sync(0xffffffffu, dot, 1);
  dot += __shfl_xor_sync(0xffffffffu, dot, 2);
  if (part == 0 && r < valid) out[r] = dot + kDenominatorEps;
}

// Row offset (in elements) of token n of (b, h) in a contiguous [B, N, H, D] output.
template <int D>
__device__ __forceinline__ size_t output_row(const Span& w, int n, int tokens, int heads) {
  return ((static_cast<size_t>(w.b) * tokens + n) * heads + w.h) * D;
}

// o = phi(Q) S' / (phi(Q) z' + eps) over the span, S' the tensor-core tile `mixed` (D x lde).
template <typename T, int D, typename AfterLast>
__device__ void output_tiles(const TokenTensor& q, const Span& w, int tokens, int heads,
                             const typename Mma<T>::elem* mixed, const float* z,
                             TileRows<T, D>& q_rows, typename Mma<T>::elem* qf, float* numerator,
                             float* denominator, T* out, AfterLast after_last) {
  using L = Layout<T, D>;
  const int lane = threadIdx.x % L::lanes;
  for (int n0 = w.begin; n0 < w.end; n0 += kTile) {
    const int valid = min(kTile, w.end - n0), rows = (valid + 15) / 16 * 16;
    __syncthreads();
    q_rows.store_features(valid, rows, qf, nullptr);
    if (n0 + kTile < w.end) {
      issue_rows<T, D>(q, w, n0 + kTile, q_rows);
    } else {
      after_last();
    }
    __syncthreads();
    denominators<T, D>(qf, z, valid, denominator);
    multiply_tile<T, D, false>(qf, mixed, numerator, rows);
    __syncthreads();
    for (int r = threadIdx.x / L::lanes; r < valid; r += L::rows_per_pass) {
      float x[L::vec];
      const float inv = 1.f / denominator[r];
#pragma unroll
      for (int i = 0; i < L::vec; ++i) x[i] = numerator[r * L::ldf + lane * L::vec + i] * inv;
      store_vector<T, D>(out + output_row<D>(w, n0 + r, tokens, heads) + lane * L::vec, x);
    }
  }
}

// Working memory of the query and key tiles.
template <typename T>
struct GradientTiles {
  typename Mma<T>::elem *kf, *vt, *qf, *dnum;  // four token tiles (kTile x lde)
  float* work;     // fp32 tile (kTile x ldf): numerator, then dphi
  float* dv_tile;  // fp32 tile (kTile x ldf) for dv (may alias qf and dnum)
  float *inv_rms, *denominator, *dden;  // kTile floats each
};

// Over the span: dq (stored), and acc += phi(Q)^T dnum, dz (this thread's column partial) +=
// phi(Q)^T dden, with dnum = dO / den, dden = -(dO . o) / den, o recomputed from S', z'.
template <typename T, int D, typename AfterLast>
__device__ void query_tiles(const TokenTensor& q, const TokenTensor& grad_out, const Span& w,
                            int tokens, int heads, const typename Mma<T>::elem* mixed,
                            const float* z, TileRows<T, D>& q_rows, TileRows<T, D>& go_rows,
                            const GradientTiles<T>& t, T* grad_q,
                            FragC<T> (&acc)[Layout<T, D>::frags_per_warp], float& dz,
                            AfterLast after_last) {
  using L = Layout<T, D>;
  using E = typename Mma<T>::elem;
  const int lane = threadIdx.x % L::lanes;
  for (int n0 = w.begin; n0 < w.end; n0 += kTile) {
    const int valid = min(kTile, w.end - n0), rows = (valid + 15) / 16 * 16;
    if (n0 != w.begin) {
      issue_rows<T, D>(q, w, n0, q_rows);
      issue_rows<T, D>(grad_out, w, n0, go_rows);
    }
    __syncthreads();
    q_rows.store_features(valid, rows, t.qf, t.inv_rms);
    __syncthreads();
    denominators<T, D>(t.qf, z, valid, t.denominator);
    multiply_tile<T, D, false>(t.qf, mixed, t.work, rows);  // numerator
    __syncthreads();
#pragma unroll
    for (int pass = 0; pass < TileRows<T, D>::passes; ++pass) {
      const int r = TileRows<T, D>::row(pass);
      if (r >= rows) break;
      float g[L::vec];
      float dot = 0.f;
      if (r < valid) {
        go_rows.values(pass, g);
        const float inv = 1.f / t.denominator[r];
#pragma unroll
        for (int i = 0; i < L::vec; ++i) {
          dot += g[i] * t.work[r * L::ldf + lane * L::vec + i] * inv;  // dO . o
          g[i] *= inv;
        }
      } else {
#pragma unroll
        for (int i = 0; i < L::vec; ++i) g[i] = 0.f;
      }
      dot = row_sum<L::lanes>(dot);
#pragma unroll
      for (int i = 0; i < L::vec; ++i)
        t.dnum[r * L::lde + lane * L::vec + i] = from_float<E>(g[i]);
      if (lane == 0) t.dden[r] = r < valid ? -dot / t.denominator[r] : 0.f;
    }
    __syncthreads();
    add_column<T, D>(t.qf, valid, t.dden, dz);
    accumulate_at_b<T, D>(acc, t.qf, t.dnum, rows);
    multiply_tile<T, D, true>(t.dnum, mixed, t.work, rows);  // dphi = dnum S'^T (+ dden z')
    __syncthreads();
#pragma unroll
    for (int pass = 0; pass < TileRows<T, D>::passes; ++pass) {  // whole warps: row shuffles
      const int r = TileRows<T, D>::row(pass);
      if (r >= rows) break;
      float x[L::vec], g[L::vec];
      const bool live = r < valid;
      q_rows.values(pass, x);
#pragma unroll
      for (int i = 0; i < L::vec; ++i) {
        const int d = lane * L::vec + i;
        if (!live) x[i] = 0.f;
        g[i] = live ? t.work[r * L::ldf + d] + t.dden[r] * z[d] : 0.f;
      }
      feature_backward<T, D>(x, live ? t.inv_rms[r] : 0.f, g);
      if (live) {
        store_vector<T, D>(grad_q + output_row<D>(w, n0 + r, tokens, heads) + lane * L::vec, g);
      }
    }
  }
  after_last();
}

// Over the span: dk from dphi(k) = V dS^T + dz, and dv = phi(K) dS (dS the tile `ds`).
template <typename T, int D, typename AfterLast>
__device__ void key_tiles(const TokenTensor& k, const TokenTensor& v, const Span& w, int tokens,
                          int heads, const typename Mma<T>::elem* ds, const float* dz,
                          TileRows<T, D>& k_rows, TileRows<T, D>& v_rows,
                          const GradientTiles<T>& t, T* grad_k, T* grad_v, AfterLast after_last) {
  using L = Layout<T, D>;
  const int lane = threadIdx.x % L::lanes;
  for (int n0 = w.begin; n0 < w.end; n0 += kTile) {
    const int valid = min(kTile, w.end - n0), rows = (valid + 15) / 16 * 16;
    if (n0 != w.begin) {
      issue_rows<T, D>(k, w, n0, k_rows);
      issue_rows<T, D>(v, w, n0, v_rows);
    }
    __syncthreads();
    k_rows.store_features(valid, rows, t.kf, t.inv_rms);
    v_rows.store_plain(rows, t.vt);
    __syncthreads();
    multiply_tile<T, D, true>(t.vt, ds, t.work, rows);      // dphi(k) = V dS^T (+ dz below)
    multiply_tile<T, D, false>(t.kf, ds, t.dv_tile, rows);  // dV = phi(K) dS
    __syncthreads();
#pragma unroll
    for (int pass = 0; pass < TileRows<T, D>::passes; ++pass) {  // whole warps, as above
      const int r = TileRows<T, D>::row(pass);
      if (r >= rows) break;
      float x[L::vec], g[L::vec];
      const bool live = r < valid;
      const size_t row = output_row<D>(w, n0 + r, tokens, heads) + lane * L::vec;
      k_rows.values(pass, x);
      if (live) {
#pragma unroll
        for (int i = 0; i < L::vec; ++i) g[i] = t.dv_tile[r * L::ldf + lane * L::vec + i];
        store_vector<T, D>(grad_v + row, g);
      }
#pragma unroll
      for (int i = 0; i < L::vec; ++i) {
        const int d = lane * L::vec + i;
        if (!live) x[i] = 0.f;
        g[i] = live ? t.work[r * L::ldf + d] + dz[d] : 0.f;
      }
      feature_backward<T, D>(x, live ? t.inv_rms[r] : 0.f, g);
      if (live) store_vector<T, D>(grad_k + row, g);
    }
  }
  after_last();
}

}  // namespace tiles
}  // namespace mhla_kernels
