#pragma once
// KDA's pairwise decays inside a chunk: scores P_ts = sum_d x_td y_sd exp(G_td - G_sd) for s <= t
// (or s < t) and their backward, with G the chunk's running gate sums [64][D] (non-increasing
// down each column). exp(G_td - G_sd) <= 1, but its two factors exp(G_td) and exp(-G_sd) can each
// leave fp32's range under strong decay, so the chunk is cut into four 16-token sub-chunks and
// every product runs on tensor cores with a reference row r per sub-chunk:
// (x_t exp(G_t - G_r)) . (y_s exp(G_r - G_s)).
//   - Pairs of different sub-chunks put r between them, so both factors are <= 1 (r = the first
//     row of the later sub-chunk, or the last row of the earlier one).
//   - Inside a sub-chunk one factor exceeds 1 by at most the sub-chunk's own decay, max_d (G_first
//     - G_last). While that stays below kSafeSubChunkDecay in every sub-chunk (so below e^60:
//     gates of the usual size, |g| < 3.75 per token) the diagonal sub-blocks join the tensor-core
//     products; otherwise they are summed element by element with exp(G_td - G_sd) itself.
// Shared-memory operands: x, y element type with rows Ld<D>::e apart, G fp32 with rows Ld<D>::f
// apart; the scratch sizes are below.
#include "gated_delta/chunk_tiles.cuh"

namespace mhla_kernels {
namespace gated_delta {

constexpr int kSub = 16;  // tokens per sub-chunk
constexpr int kSubs = kC / kSub;
constexpr float kSafeSubChunkDecay = 60.f;
constexpr int kCopyRows = 160;                      // four scaled copies: 16 + 32 + 48 + 64 rows
constexpr int kScoresScratchRows = kCopyRows + kC;  // per_key_scores (also the scaled x rows)
constexpr int kScoresBackwardScratchRows = kCopyRows;

// Copies of the rows "up to sub-chunk I" (I = 0..3: rows s < 16 (I + 1)) scaled to the first row
// of I start at row 16 I (I + 1) / 2; copies of the rows "from sub-chunk J" (J = 0..3: rows
// t >= 16 J) scaled to the last row of J at row 64 J - 8 J (J - 1).
__device__ __forceinline__ int rows_upto_offset(int i) {
  return kSub * i * (i + 1) / 2;
}
__device__ __forceinline__ int rows_from_offset(int j) {
  return 64 * j - 8 * j * (j - 1);
}

// Whether every sub-chunk decays by less than kSafeSubChunkDecay in every key dimension (the
// diagonal sub-blocks may then run on tensor cores). A barrier: all threads must call it.
template <int D, int Threads>
__device__ bool diagonal_on_tensor_cores(const float* g) {
  constexpr int ldg = Ld<D>::f;
  int unsafe = 0;
  for (int e = threadIdx.x; e < kSubs * D; e += Threads) {
    const int i = e / D, d = e % D;
    unsafe |= g[kSub * i * ldg + d] - g[(kSub * i + kSub - 1) * ldg + d] > kSafeSubChunkDecay;
  }
  return __syncthreads_or(unsafe) == 0;
}

// dst[0, 8) = src[0, 8) * exp(a[0, 8) - b[0, 8)): eight columns of a decayed copy in 16-byte
// shared-memory accesses (a and b point into rows of G; every operand 16-byte aligned). The
// fills below are the scores' elementwise cost: two-column accesses issued four times as many
// shared-memory instructions.
template <typename T>
__device__ __forceinline__ void decayed8(T* dst, const T* src, const float* a, const float* b) {
  float x[8];
  load_pack<T, 8>(src, x);
  const float4 a0 = *reinterpret_cast<const float4*>(a);
  const float4 a1 = *reinterpret_cast<const float4*>(a + 4);
  const float4 b0 = *reinterpret_cast<const float4*>(b);
  const float4 b1 = *reinterpret_cast<const float4*>(b + 4);
  x[0] *= __expf(a0.x - b0.x);
  x[1] *= __expf(a0.y - b0.y);
  x[2] *= __expf(a0.z - b0.z);
  x[3] *= __expf(a0.w - b0.w);
  x[4] *= __expf(a1.x - b1.x);
  x[5] *= __expf(a1.y - b1.y);
  x[6] *= __expf(a1.z - b1.z);
  x[7] *= __expf(a1.w - b1.w);
  store_pack<T, 8>(dst, x);
}

// copies[rows_upto_offset(I) + s] = y_s exp(G_16I - G_s) for s < 16 I, and for s < 16 (I + 1)
// when the diagonal blocks are included.
template <typename T, int D, int Threads>
__device__ void fill_rows_upto(T* copies, const T* y, const float* g, bool with_diagonal) {
  constexpr int ld = Ld<D>::e, ldg = Ld<D>::f;
  for (int e = threadIdx.x; e < kCopyRows * (D / 8); e += Threads) {
    const int row = e / (D / 8), c = 8 * (e % (D / 8));
    const int i = row < 16 ? 0 : (row < 48 ? 1 : (row < 96 ? 2 : 3));
    const int s = row - rows_upto_offset(i), ref = kSub * i;
    if (s >= ref && !with_diagonal) continue;
    decayed8(copies + row * ld + c, y + s * ld + c, g + ref * ldg + c, g + s * ldg + c);
  }
}

// copies[rows_from_offset(J) + t - 16 J] = x_t exp(G_t - G_(16J+15)) for t >= 16 (J + 1), and
// for t >= 16 J when the diagonal blocks are included.
template <typename T, int D, int Threads>
__device__ void fill_rows_from(T* copies, const T* x, const float* g, bool with_diagonal) {
  constexpr int ld = Ld<D>::e, ldg = Ld<D>::f;
  for (int e = threadIdx.x; e < kCopyRows * (D / 8); e += Threads) {
    const int row = e / (D / 8), c = 8 * (e % (D / 8));
    const int j = row < 64 ? 0 : (row < 112 ? 1 : (row < 144 ? 2 : 3));
    const int t = kSub * j + row - rows_from_offset(j), ref = kSub * j + kSub - 1;
    if (t <= ref && !with_diagonal) continue;
    decayed8(copies + row * ld + c, x + t * ld + c, g + t * ldg + c, g + ref * ldg + c);
  }
}

// The (I, J) sub-block pair number k of those with J < I (or J <= I when with_diagonal), in
// order of I.
__device__ __forceinline__ void pair_of(int k, bool with_diagonal, int& i, int& j) {
  // Pairs before sub-chunk I: I (I + 1) / 2 with the diagonal blocks, I (I - 1) / 2 without.
  const int shift = with_diagonal ? 1 : -1;
  auto before = [shift](int n) { return n * (n + shift) / 2; };
  i = 0;
  while (before(i + 1) <= k) ++i;
  j = k - before(i);
}

// p (fp32 [64][68]) = the scores of x against y: s < t, or s <= t with Diagonal; zeros above.
// Starts after a barrier that published x, y and g (and is one itself: diagonal_on_tensor_cores);
// scratch holds kScoresScratchRows rows; ends synchronized. y_copies_ready: the scratch still
// holds y's decayed copies from a previous call with the same y and g (only x's rows are made).
template <typename T, int D, int Threads, bool Diagonal>
__device__ void per_key_scores(const T* x, const T* y, const float* g, T* scratch, float* p,
                               bool y_copies_ready = false) {
  constexpr int ld = Ld<D>::e, ldg = Ld<D>::f;
  const bool on_cores = diagonal_on_tensor_cores<D, Threads>(g);
  T* x_scaled = scratch + kCopyRows * ld;  // x_t exp(G_t - G_(first row of t's sub-chunk))
  for (int e = threadIdx.x; e < kC * (D / 8); e += Threads) {
    const int t = e / (D / 8), c = 8 * (e % (D / 8)), ref = t & ~(kSub - 1);
    decayed8(x_scaled + t * ld + c, x + t * ld + c, g + t * ldg + c, g + ref * ldg + c);
  }
  if (!y_copies_ready) fill_rows_upto<T, D, Threads>(scratch, y, g, on_cores);
  __syncthreads();
  const int pairs = on_cores ? 10 : 6;
  for (int k = threadIdx.x / 32; k < pairs; k += Threads / 32) {
    int i, j;
    pair_of(k, on_cores, i, j);
    wmma_tiles::TileAccumulator acc;
    acc.zero();
    wmma_tiles::mma_tile<T, false, true>(acc, x_scaled + kSub * i * ld, ld,
                                         scratch + (rows_upto_offset(i) + kSub * j) * ld, ld, 0, 0,
                                         D);
    if (i == j) {  // the diagonal sub-block: zeros above its diagonal
#pragma unroll
      for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const int t = wmma_tiles::TileAccumulator::row(q);
          const int s = wmma_tiles::TileAccumulator::col(h, q);
          if (s > t || (!Diagonal && s == t)) acc.x[h][q] = 0.f;
        }
      }
    }
    acc.store(p + kSub * i * kLdSquare + kSub * j, kLdSquare);
  }
  // Zeros above the diagonal sub-blocks.
  for (int e = threadIdx.x; e < kC * kC / 4; e += Threads) {
    const int t = e / (kC / 4), s = 4 * (e % (kC / 4));
    if (s / kSub > t / kSub) *reinterpret_cast<float4*>(p + t * kLdSquare + s) = float4{};
  }
  if (!on_cores) {  // the diagonal sub-blocks element by element
    for (int e = threadIdx.x; e < kSubs * kSub * kSub; e += Threads) {
      const int base = kSub * (e / (kSub * kSub)), t = base + (e / kSub) % kSub;
      const int s = base + e % kSub;
      float sum = 0.f;
      if (s < t || (Diagonal && s == t)) {
        for (int c = 0; c < D; ++c) {
          sum += to_float(x[t * ld + c]) * to_float(y[s * ld + c]) *
                 __expf(g[t * ldg + c] - g[s * ldg + c]);
        }
      }
      p[t * kLdSquare + s] = sum;
    }
  }
  __syncthreads();
}

// The backward of per_key_scores for m = dL/dp (element type [64][72], zeros above the diagonal):
//   r[t][d] += sum_s m_ts y_sd exp(G_td - G_sd)    (dL/dx)
//   c[s][d] += sum_t m_ts x_td exp(G_td - G_sd)    (dL/dy)
// r and c fp32 rows of Ld<D>::f. Starts after a barrier that published m, x, y, g (and r, c);
// scratch (kScoresBackwardScratchRows rows) may alias anything else; ends synchronized.
template <typename T, int D, int Threads>
__device__ void per_key_scores_backward(const T* m, const T* x, const T* y, const float* g,
                                        T* scratch, float* r, float* c) {
  constexpr int ld = Ld<D>::e, ldg = Ld<D>::f, ldr = Ld<D>::f;
  constexpr int kColTiles = D / 16;
  const bool on_cores = diagonal_on_tensor_cores<D, Threads>(g);
  if (!on_cores) {  // the diagonal sub-blocks element by element, (t, d) by one thread
    for (int e = threadIdx.x; e < kC * D; e += Threads) {
      const int t = e / D, d = e % D, base = t & ~(kSub - 1);
      const float gt = g[t * ldg + d];
      float from_rows = 0.f, from_cols = 0.f;
      for (int s = base; s <= t; ++s) {  // r: m_ts y_sd
        from_rows +=
            to_float(m[t * kLdSquareE + s]) * to_float(y[s * ld + d]) * __expf(gt - g[s * ldg + d]);
      }
      for (int u = t; u < base + kSub; ++u) {  // c (t as the column): m_ut x_ud
        from_cols +=
            to_float(m[u * kLdSquareE + t]) * to_float(x[u * ld + d]) * __expf(g[u * ldg + d] - gt);
      }
      r[t * ldr + d] += from_rows;
      c[t * ldr + d] += from_cols;
    }
  }
  // r of sub-chunk I over the rows up to it, then c of sub-chunk J over the rows from it; one
  // 16 x 16 output tile per item, scaled back from the reference row.
  for (int side = 0; side < 2; ++side) {
    if (side == 0) {
      fill_rows_upto<T, D, Threads>(scratch, y, g, on_cores);
    } else {
      fill_rows_from<T, D, Threads>(scratch, x, g, on_cores);
    }
    __syncthreads();
    const int first = side == 0 ? (on_cores ? 0 : 1) : 0;
    const int parts = side == 0 ? kSubs - first : (on_cores ? kSubs : kSubs - 1);
    for (int item = threadIdx.x / 32; item < parts * kColTiles; item += Threads / 32) {
      const int part = first + item / kColTiles, fn = item % kColTiles;
      const int row0 = kSub * part;
      wmma_tiles::TileAccumulator acc;
      acc.zero();
      int ref;
      if (side == 0) {
        ref = row0;
        const int depth = kSub * part + (on_cores ? kSub : 0);
        wmma_tiles::mma_tile<T, false, false>(acc, m + row0 * kLdSquareE, kLdSquareE,
                                              scratch + rows_upto_offset(part) * ld, ld, 0, fn,
                                              depth);
      } else {
        ref = row0 + kSub - 1;
        const int from = on_cores ? row0 : row0 + kSub;
        wmma_tiles::mma_tile<T, true, false>(acc, m + from * kLdSquareE + row0, kLdSquareE,
                                             scratch + (rows_from_offset(part) + from - row0) * ld,
                                             ld, 0, fn, kC - from);
      }
      // Scaled back and added in pairs of columns (the accumulator's x[h][2i], x[h][2i + 1] are
      // adjacent): 8-byte shared-memory accesses.
      float* out = side == 0 ? r : c;
      const int lane = threadIdx.x % 32;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int d = 16 * fn + 8 * h + 2 * (lane % 4);
        const float2 g_ref = *reinterpret_cast<const float2*>(g + ref * ldg + d);
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int t = row0 + lane / 4 + 8 * half;
          const float2 g_t = *reinterpret_cast<const float2*>(g + t * ldg + d);
          float2& o = *reinterpret_cast<float2*>(out + t * ldr + d);
          float2 sum = o;
          const float sign = side == 0 ? 1.f : -1.f;
          sum.x += acc.x[h][2 * half] * __expf(sign * (g_t.x - g_ref.x));
          sum.y += acc.x[h][2 * half + 1] * __expf(sign * (g_t.y - g_ref.y));
          o = sum;
        }
      }
    }
    __syncthreads();
  }
}

}  // namespace gated_delta
}  // namespace mhla_kernels
