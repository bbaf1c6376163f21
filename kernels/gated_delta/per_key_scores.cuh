#pragma once
// KDA's pairwise decays inside a chunk: scores P_ts = sum_d x_td y_sd exp(G_td - G_sd) for s <= t
// (or s < t) and their backward, with G the chunk's running gate sums [64][D] (non-increasing
// down each column). exp(G_td - G_sd) <= 1, but its two factors exp(G_td) and exp(-G_sd) can each
// leave fp32's range under strong decay, so the chunk is cut into four 16-token sub-chunks:
//   - a pair of sub-chunks I > J runs on tensor cores with a reference row between them:
//     (x_t exp(G_t - G_ref)) . (y_s exp(G_ref - G_s)), both factors <= 1 (ref = the first row of
//     I for products over J < I; the last row of J for products over I > J);
//   - the four diagonal sub-blocks are summed element by element with exp(G_td - G_sd) itself.
// Shared-memory operands: x, y element type with rows Ld<D>::e apart, G fp32 with rows Ld<D>::f
// apart; scratch holds kScaledRows rows of Ld<D>::e elements.
#include "gated_delta/chunk_tiles.cuh"

namespace mhla_kernels {
namespace gated_delta {

constexpr int kSub = 16;              // tokens per sub-chunk
constexpr int kScaledRows = 96 + 96;  // scratch rows (see below)

// Row offset (in scratch) of sub-chunk I's copy of the rows s < 16 I (I = 1, 2, 3): 0, 16, 48.
__device__ __forceinline__ int rows_before_offset(int i) {
  return kSub * (i * (i - 1) / 2);
}
// Row offset (in scratch, after the first 96 rows) of sub-chunk J's copy of the rows t >= 16
// (J + 1) (J = 0, 1, 2): 0, 48, 80.
__device__ __forceinline__ int rows_after_offset(int j) {
  return j == 0 ? 0 : (j == 1 ? 48 : 80);
}

// scratch[0, 96): for I = 1..3, y_s exp(G_16I - G_s) for s < 16 I ("rows before I", ref = the
// first row of I). With AfterRows, scratch[96, 192): for J = 0..2, x_t exp(G_t - G_(16J+15)) for
// t >= 16 (J + 1) ("rows after J", ref = the last row of J). Ends synchronized.
template <typename T, int D, int Threads, bool AfterRows>
__device__ void fill_scaled_rows(T* scratch, const T* x, const T* y, const float* g) {
  constexpr int ld = Ld<D>::e, ldg = Ld<D>::f;
  constexpr int kRows = AfterRows ? 192 : 96;
  for (int e = threadIdx.x; e < kRows * (D / 2); e += Threads) {
    const int row = e / (D / 2), c = 2 * (e % (D / 2));
    const T* src;
    int from, ref;
    if (row < 96) {
      const int i = row < 16 ? 1 : (row < 48 ? 2 : 3);
      from = row - rows_before_offset(i);
      ref = kSub * i;
      src = y;
    } else {
      const int r = row - 96, j = r < 48 ? 0 : (r < 80 ? 1 : 2);
      from = kSub * (j + 1) + r - rows_after_offset(j);
      ref = kSub * j + kSub - 1;
      src = x;
    }
    const bool before = row < 96;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float d = before ? g[ref * ldg + c + h] - g[from * ldg + c + h]
                             : g[from * ldg + c + h] - g[ref * ldg + c + h];
      scratch[row * ld + c + h] = from_float<T>(to_float(src[from * ld + c + h]) * __expf(d));
    }
  }
  __syncthreads();
}

// p (fp32 [64][68]) = the scores of x against y: s < t, or s <= t with Diagonal; zeros above.
// The x rows scaled for the tensor-core pairs go into scratch[96, 144). Starts after a barrier
// that published x, y and g; ends synchronized.
template <typename T, int D, int Threads, bool Diagonal>
__device__ void per_key_scores(const T* x, const T* y, const float* g, T* scratch, float* p) {
  constexpr int ld = Ld<D>::e, ldg = Ld<D>::f;
  T* x_scaled = scratch + 96 * ld;  // rows t >= 16 by x_t exp(G_t - G_(first row of t's sub-chunk))
  for (int e = threadIdx.x; e < 48 * (D / 2); e += Threads) {
    const int row = e / (D / 2), c = 2 * (e % (D / 2)), t = kSub + row, ref = t & ~(kSub - 1);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      x_scaled[row * ld + c + h] = from_float<T>(to_float(x[t * ld + c + h]) *
                                                 __expf(g[t * ldg + c + h] - g[ref * ldg + c + h]));
    }
  }
  fill_scaled_rows<T, D, Threads, false>(scratch, x, y, g);  // synchronizes
  const int warp = threadIdx.x / 32;
  if (warp < 6) {
    // Pairs (I, J), J < I: warp 0 (1, 0), 1-2 (2, 0-1), 3-5 (3, 0-2).
    const int i = warp < 1 ? 1 : (warp < 3 ? 2 : 3), j = warp - i * (i - 1) / 2;
    wmma_tiles::TileAccumulator acc;
    acc.zero();
    wmma_tiles::mma_tile<T, false, true>(acc, x_scaled + (kSub * i - kSub) * ld, ld,
                                         scratch + (rows_before_offset(i) + kSub * j) * ld, ld, 0,
                                         0, D);
    acc.store(p + kSub * i * kLdSquare + kSub * j, kLdSquare);
  }
  // Zeros above the diagonal sub-blocks.
  for (int e = threadIdx.x; e < kC * kC; e += Threads) {
    const int t = e / kC, s = e % kC;
    if (s / kSub > t / kSub) p[t * kLdSquare + s] = 0.f;
  }
  // The diagonal sub-blocks, element by element.
  for (int e = threadIdx.x; e < (kC / kSub) * kSub * kSub; e += Threads) {
    const int base = kSub * (e / (kSub * kSub)), t = base + (e / kSub) % kSub, s = base + e % kSub;
    float sum = 0.f;
    if (s < t || (Diagonal && s == t)) {
      for (int c = 0; c < D; ++c) {
        sum += to_float(x[t * ld + c]) * to_float(y[s * ld + c]) *
               __expf(g[t * ldg + c] - g[s * ldg + c]);
      }
    }
    p[t * kLdSquare + s] = sum;
  }
  __syncthreads();
}

// The backward of per_key_scores for m = dL/dp (element type [64][72], zeros above the diagonal):
//   r[t][d] += sum_s m_ts y_sd exp(G_td - G_sd)    (dL/dx)
//   c[s][d] += sum_t m_ts x_td exp(G_td - G_sd)    (dL/dy)
// r and c fp32 rows of Ld<D>::f. Starts after a barrier that published m, x, y, g (and r, c);
// scratch may alias anything else; ends synchronized.
template <typename T, int D, int Threads>
__device__ void per_key_scores_backward(const T* m, const T* x, const T* y, const float* g,
                                        T* scratch, float* r, float* c) {
  constexpr int ld = Ld<D>::e, ldg = Ld<D>::f, ldr = Ld<D>::f;
  // The diagonal sub-blocks first (each (t, d) by one thread; s and t within t's sub-chunk).
  for (int e = threadIdx.x; e < kC * D; e += Threads) {
    const int t = e / D, d = e % D, base = t & ~(kSub - 1);
    const float gt = g[t * ldg + d];
    float from_rows = 0.f, from_cols = 0.f;
    for (int s = base; s <= t; ++s) {  // r: m_ts y_sd
      from_rows +=
          to_float(m[t * kLdSquareE + s]) * to_float(y[s * ld + d]) * __expf(gt - g[s * ldg + d]);
    }
    for (int u = t; u < base + kSub; ++u) {  // c (t as the column): m_ut x_ud exp(G_ud - G_td)
      from_cols +=
          to_float(m[u * kLdSquareE + t]) * to_float(x[u * ld + d]) * __expf(g[u * ldg + d] - gt);
    }
    r[t * ldr + d] += from_rows;
    c[t * ldr + d] += from_cols;
  }
  fill_scaled_rows<T, D, Threads, true>(scratch, x, y, g);  // synchronizes
  // Tensor-core parts: r of sub-chunk I (I = 1..3) over the rows before it, c of sub-chunk J
  // (J = 0..2) over the rows after it; one 16 x 16 output tile per item.
  constexpr int kColTiles = D / 16, kItems = 2 * 3 * kColTiles;
  for (int item = threadIdx.x / 32; item < kItems; item += Threads / 32) {
    const bool rows_side = item < 3 * kColTiles;
    const int part = (rows_side ? item : item - 3 * kColTiles) / kColTiles;
    const int fn = item % kColTiles;
    wmma_tiles::TileAccumulator acc;
    acc.zero();
    int row0, ref;
    if (rows_side) {
      const int i = part + 1;
      row0 = kSub * i;
      ref = row0;
      wmma_tiles::mma_tile<T, false, false>(acc, m + row0 * kLdSquareE, kLdSquareE,
                                            scratch + rows_before_offset(i) * ld, ld, 0, fn,
                                            kSub * i);
    } else {
      const int j = part;
      row0 = kSub * j;
      ref = row0 + kSub - 1;
      wmma_tiles::mma_tile<T, true, false>(acc, m + kSub * (j + 1) * kLdSquareE + row0, kLdSquareE,
                                           scratch + (96 + rows_after_offset(j)) * ld, ld, 0, fn,
                                           kC - kSub * (j + 1));
    }
    float* out = rows_side ? r : c;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int t = row0 + wmma_tiles::TileAccumulator::row(q);
        const int d = 16 * fn + wmma_tiles::TileAccumulator::col(h, q);
        const float diff =
            rows_side ? g[t * ldg + d] - g[ref * ldg + d] : g[ref * ldg + d] - g[t * ldg + d];
        out[t * ldr + d] += acc.x[h][q] * __expf(diff);
      }
    }
  }
  __syncthreads();
}

}  // namespace gated_delta
}  // namespace mhla_kernels
