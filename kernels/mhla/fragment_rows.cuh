#pragma once
// Building blocks of the bidirectional token passes on mma.sync fragments
// (block_fragment_passes.h): each warp of a four-warp CTA owns 16 token rows of a 64-token tile and
// sees them in two forms.
//   row form:         two lanes per row, each with half of the row's D elements as 16-byte words
//                     (lane 2r and 2r + 1 of the warp hold row r), for the row sums of the
//                     feature map and the normalizer (one shuffle each);
//   accumulator form: the rows as TileAccumulator tiles (16 rows x 16 columns, mma.sync's C
//                     layout), for the products and what follows them, and back to shared memory
//                     as element pairs for 16-byte stores.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstddef>
#include <type_traits>

#include "common/element_type.cuh"
#include "common/wmma_gemm.cuh"
#include "mhla/state_tiles.cuh"
#include "mhla/tiles.cuh"

namespace mhla_kernels {
namespace fragment_rows {

using wmma_tiles::TileAccumulator;

constexpr int kFragmentThreads = 128;  // four warps: 64 rows

template <int D>
struct RowHalves {
  static constexpr int half = D / 2;      // elements of a row per lane
  static constexpr int words = half / 8;  // 16-byte words per lane
  static constexpr int tiles = D / 16;    // accumulator tiles across D
};

// The tile row and the half of it that this lane holds in row form.
__device__ __forceinline__ int lane_row() {
  return static_cast<int>(threadIdx.x / 32) * 16 + static_cast<int>(threadIdx.x % 32) / 2;
}
__device__ __forceinline__ int lane_half() {
  return static_cast<int>(threadIdx.x % 2);
}

// 16-bit element pairs <-> fp32: unpack_pair and pack_pair (common/element_type.cuh), eight
// elements (one 16-byte word) at a time.
template <typename E>
__device__ __forceinline__ void to_floats(const uint4& word, float (&x)[8]) {
  unpack_pair<E>(word.x, x[0], x[1]);
  unpack_pair<E>(word.y, x[2], x[3]);
  unpack_pair<E>(word.z, x[4], x[5]);
  unpack_pair<E>(word.w, x[6], x[7]);
}

template <typename E>
__device__ __forceinline__ uint4 from_floats(const float (&x)[8]) {
  return make_uint4(pack_pair<E>(x[0], x[1]), pack_pair<E>(x[2], x[3]), pack_pair<E>(x[4], x[5]),
                    pack_pair<E>(x[6], x[7]));
}

// This lane's half of token row `row` of x (zeros when !live), as 16-byte words.
template <typename T, int D>
__device__ __forceinline__ void load_half(const TokenTensor& x, int b, int n, int h, bool live,
                                          uint4 (&words)[RowHalves<D>::words]) {
  using R = RowHalves<D>;
#pragma unroll
  for (int u = 0; u < R::words; ++u) words[u] = make_uint4(0u, 0u, 0u, 0u);
  if (!live) return;
  const T* at = tiles::token_row<T, D>(x, b, n, h) + lane_half() * R::half;
#pragma unroll
  for (int u = 0; u < R::words; ++u) words[u] = *reinterpret_cast<const uint4*>(at + u * 8);
}

// This lane's half of a shared tile row (the pipelined passes' row form reads its input from the
// stage), as 16-byte words.
template <typename E, int D>
__device__ __forceinline__ void read_half(const E* tile_row, uint4 (&words)[RowHalves<D>::words]) {
  using R = RowHalves<D>;
#pragma unroll
  for (int u = 0; u < R::words; ++u)
    words[u] = *reinterpret_cast<const uint4*>(tile_row + lane_half() * R::half + u * 8);
}

// 1 / rms(x) of the row whose half this lane holds (both lanes of the pair get it).
template <typename E, int D>
__device__ __forceinline__ float row_scale(const uint4 (&words)[RowHalves<D>::words]) {
  float squares = 0.f;
#pragma unroll
  for (int u = 0; u < RowHalves<D>::words; ++u) {
    float x[8];
    to_floats<E>(words[u], x);
#pragma unroll
    for (int i = 0; i < 8; ++i) squares += x[i] * x[i];
  }
  squares += __shfl_xor_sync(0xffffffffu, squares, 1);
  return rsqrtf(squares / D + tiles::kNormEps);
}

// phi(x) = relu(x * scale) + floor of one word, rounded to E as the products see it: the word to
// store, and its values in fp32 in phi. Zero for rows past the tile's end (padding must be zero,
// not the floor). For bf16 the map runs on packed pairs, as in the resident kernels
// (resident_tiles.cuh, features_of_piece): relu(x) * s + floor as two fused multiply-adds with s
// split into a bf16 high and low part (s_lo x + floor, then s_hi x + that), which gives the fp32
// result's rounding up to a rare last-bit tie in 12 instructions per word instead of about 36
// (the split is the same for every word of a row, so it is computed once). fp16 keeps fp32
// arithmetic: a small rms can put the scale past fp16's range.
template <typename E>
__device__ __forceinline__ uint4 feature_word(const uint4& word, float scale, bool live,
                                              float (&phi)[8]) {
  uint4 rounded;
  if constexpr (std::is_same_v<E, __nv_bfloat16>) {
    const __nv_bfloat16 high = __float2bfloat16_rn(scale);
    const __nv_bfloat162 s_hi = __bfloat162bfloat162(high),
                         s_lo = __float2bfloat162_rn(scale - __bfloat162float(high)),
                         floor = __float2bfloat162_rn(tiles::kFeatureFloor),
                         zero = __float2bfloat162_rn(0.f);
    rounded = word;
    __nv_bfloat162* pairs = reinterpret_cast<__nv_bfloat162*>(&rounded);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const __nv_bfloat162 positive = __hmax2(pairs[i], zero);
      pairs[i] = __hfma2(positive, s_hi, __hfma2(positive, s_lo, floor));
    }
    if (!live) rounded = make_uint4(0u, 0u, 0u, 0u);
  } else {
    float x[8];
    to_floats<E>(word, x);
#pragma unroll
    for (int i = 0; i < 8; ++i) x[i] = live ? fmaxf(x[i] * scale, 0.f) + tiles::kFeatureFloor : 0.f;
    rounded = from_floats<E>(x);
  }
  to_floats<E>(rounded, phi);
  return rounded;
}

// x * scale of one word, rounded to E. For bf16 on packed pairs with the scale split into a bf16
// high and low part (x s_hi + x s_lo, the low product rounded first: its error is below 2^-16 of
// the result), 8 instructions per word instead of 20; fp16 in fp32 (range, as feature_word).
template <typename E>
__device__ __forceinline__ uint4 scaled_word(const uint4& word, float scale) {
  if constexpr (std::is_same_v<E, __nv_bfloat16>) {
    const __nv_bfloat16 high = __float2bfloat16_rn(scale);
    const __nv_bfloat162 s_hi = __bfloat162bfloat162(high),
                         s_lo = __float2bfloat162_rn(scale - __bfloat162float(high));
    uint4 out = word;
    __nv_bfloat162* pairs = reinterpret_cast<__nv_bfloat162*>(&out);
#pragma unroll
    for (int i = 0; i < 4; ++i) pairs[i] = __hfma2(pairs[i], s_hi, __hmul2(pairs[i], s_lo));
    return out;
  } else {
    float x[8];
    to_floats<E>(word, x);
#pragma unroll
    for (int i = 0; i < 8; ++i) x[i] *= scale;
    return from_floats<E>(x);
  }
}

// phi(x) of this lane's half row into the tile row at `tile_row` (its half of it).
template <typename E, int D>
__device__ __forceinline__ void features_row(const uint4 (&raw)[RowHalves<D>::words], float scale,
                                             bool live, E* tile_row) {
  using R = RowHalves<D>;
#pragma unroll
  for (int u = 0; u < R::words; ++u) {
    float unused[8];
    *reinterpret_cast<uint4*>(tile_row + lane_half() * R::half + u * 8) =
        feature_word<E>(raw[u], scale, live, unused);
  }
}

// phi(q) of this lane's half row into the tile row at `tile_row` (its half of it), and this
// lane's part of phi(q) . z (z fp32 over all D): pair_sum() of the result is the whole dot.
template <typename E, int D>
__device__ __forceinline__ float features_dot(const uint4 (&raw)[RowHalves<D>::words], float scale,
                                              bool live, const float* z, E* tile_row) {
  using R = RowHalves<D>;
  float dot = 0.f;
#pragma unroll
  for (int u = 0; u < R::words; ++u) {
    const int d0 = lane_half() * R::half + u * 8;
    float x[8];
    *reinterpret_cast<uint4*>(tile_row + d0) = feature_word<E>(raw[u], scale, live, x);
    const float4 z0 = *reinterpret_cast<const float4*>(z + d0);
    const float4 z1 = *reinterpret_cast<const float4*>(z + d0 + 4);
    dot += x[0] * z0.x + x[1] * z0.y + x[2] * z0.z + x[3] * z0.w + x[4] * z1.x + x[5] * z1.y +
           x[6] * z1.z + x[7] * z1.w;
  }
  return dot;
}

// The sum over a row of this lane's partial sum and its pair's.
__device__ __forceinline__ float pair_sum(float x) {
  return x + __shfl_xor_sync(0xffffffffu, x, 1);
}

// Accumulator-form rows of this lane: tile rows first + lane/4 and first + lane/4 + 8.
__device__ __forceinline__ int accumulator_row(int r) {
  return static_cast<int>(threadIdx.x / 32) * 16 + static_cast<int>(threadIdx.x % 32) / 4 + 8 * r;
}

// The feature backward of the warp's 16 rows in accumulator form: g holds d(loss)/d(phi)
// without the normalizer's term, which is row_coef[r] * col_add[c] (dden * z' for queries,
// dz for keys). x_tile holds the raw rows (tile row stride ld); 1/rms per row in scale.
// Writes dx as element pairs into out_tile (may be x_tile: every read is done first).
// With y = s x (s = 1/rms > 0, so y > 0 exactly where x > 0) and g masked to y > 0:
//   dx = s (g - y (g . y) / D) = s g - x (s^3 (g . x) / D),
// so the row sum runs on the raw x and each element takes one product and one fused
// multiply-add (session 44: 6.5 -> 5 instructions an element in the sum, 3.5 in the output).
// Without kColumnTerm, g holds the whole d(loss)/d(phi) already (row_coef, col_add unread).
template <typename E, int D, bool kColumnTerm = true>
__device__ __forceinline__ void feature_backward(TileAccumulator (&g)[1][D / 16], const E* x_tile,
                                                 E* out_tile, int ld, const float (&scale)[2],
                                                 const float (&row_coef)[2], const float* col_add) {
  namespace mma = wmma_tiles::detail;
  const int lane = static_cast<int>(threadIdx.x % 32), quad = lane / 8, row8 = lane % 8;
  const int first = static_cast<int>(threadIdx.x / 32) * 16;
  // ldmatrix of 16-bit rows returns them in the accumulators' layout: register 2h + r holds
  // row lane/4 + 8r, columns 8h + 2 (lane % 4) and the next.
  unsigned xf[D / 16][4];
#pragma unroll
  for (int j = 0; j < D / 16; ++j) {
    mma::load_matrices<false>(
        xf[j], x_tile + (first + (quad % 2) * 8 + row8) * ld + j * 16 + (quad / 2) * 8);
  }
  float dot[2] = {0.f, 0.f};  // g . x per row
#pragma unroll
  for (int j = 0; j < D / 16; ++j) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int c = j * 16 + h * 8 + (lane % 4) * 2;
      const float2 add =
          kColumnTerm ? *reinterpret_cast<const float2*>(col_add + c) : make_float2(0.f, 0.f);
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float x0, x1;
        unpack_pair<E>(xf[j][h * 2 + r], x0, x1);
        float& g0 = g[0][j].x[h][2 * r];
        float& g1 = g[0][j].x[h][2 * r + 1];
        if constexpr (kColumnTerm) {
          g0 = x0 > 0.f ? fmaf(row_coef[r], add.x, g0) : 0.f;
          g1 = x1 > 0.f ? fmaf(row_coef[r], add.y, g1) : 0.f;
        } else {
          g0 = x0 > 0.f ? g0 : 0.f;
          g1 = x1 > 0.f ? g1 : 0.f;
        }
        dot[r] = fmaf(g0, x0, dot[r]);
        dot[r] = fmaf(g1, x1, dot[r]);
      }
    }
  }
  float coef[2];  // s^3 (g . x) / D
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    dot[r] += __shfl_xor_sync(0xffffffffu, dot[r], 1);
    dot[r] += __shfl_xor_sync(0xffffffffu, dot[r], 2);
    coef[r] = scale[r] * scale[r] * scale[r] * (dot[r] * (1.f / D));
  }
  __syncwarp();  // every lane's reads of x_tile are done before out_tile is written
#pragma unroll
  for (int j = 0; j < D / 16; ++j) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int c = j * 16 + h * 8 + (lane % 4) * 2;
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float x0, x1;
        unpack_pair<E>(xf[j][h * 2 + r], x0, x1);
        const float dx0 = fmaf(-x0, coef[r], scale[r] * g[0][j].x[h][2 * r]);
        const float dx1 = fmaf(-x1, coef[r], scale[r] * g[0][j].x[h][2 * r + 1]);
        *reinterpret_cast<unsigned*>(out_tile + (first + lane / 4 + 8 * r) * ld + c) =
            pack_pair<E>(dx0, dx1);
      }
    }
  }
}

// Sum over row accumulator_row(r) of acc times a 16-bit tile's same row (the warp's rows, tile
// row stride ld): both in accumulator form, the tile's through ldmatrix. Every lane of the
// row's quad gets the sum.
template <typename E, int D>
__device__ __forceinline__ float row_dot(const TileAccumulator (&acc)[1][D / 16], const E* tile,
                                         int ld, int r) {
  namespace mma = wmma_tiles::detail;
  const int lane = static_cast<int>(threadIdx.x % 32), quad = lane / 8, row8 = lane % 8;
  const int first = static_cast<int>(threadIdx.x / 32) * 16;
  float dot = 0.f;
#pragma unroll
  for (int j = 0; j < D / 16; ++j) {
    unsigned pairs[4];
    mma::load_matrices<false>(
        pairs, tile + (first + (quad % 2) * 8 + row8) * ld + j * 16 + (quad / 2) * 8);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float a, b;
      unpack_pair<E>(pairs[h * 2 + r], a, b);
      dot += a * acc[0][j].x[h][2 * r] + b * acc[0][j].x[h][2 * r + 1];
    }
  }
  dot += __shfl_xor_sync(0xffffffffu, dot, 1);
  return dot + __shfl_xor_sync(0xffffffffu, dot, 2);
}

// The warp's 16 rows of accumulators, each row times row_factor[r], as element pairs into tile.
template <typename E, int D>
__device__ __forceinline__ void store_rows(const TileAccumulator (&acc)[1][D / 16],
                                           const float (&row_factor)[2], E* tile, int ld) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int first = static_cast<int>(threadIdx.x / 32) * 16;
#pragma unroll
  for (int j = 0; j < D / 16; ++j) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int c = j * 16 + h * 8 + (lane % 4) * 2;
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        *reinterpret_cast<unsigned*>(tile + (first + lane / 4 + 8 * r) * ld + c) = pack_pair<E>(
            acc[0][j].x[h][2 * r] * row_factor[r], acc[0][j].x[h][2 * r + 1] * row_factor[r]);
      }
    }
  }
}

// The warp's 16 rows of a shared tile to a contiguous [B, N, H, D] tensor at token n0 of
// (b, h), 16 bytes per store; rows at or past `valid` (tile rows) are not written. Each lane
// stores one 16-byte column of every (32 / words per row)-th row: one 64-bit base, fixed steps.
template <typename T, int D>
__device__ __forceinline__ void copy_rows_out(const T* tile, int ld, T* out, int tokens, int heads,
                                              int b, int h, int n0, int valid) {
  constexpr int kWordsPerRow = D / 8, kRowsPerPass = 32 / kWordsPerRow;
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int row = static_cast<int>(threadIdx.x / 32) * 16 + lane / kWordsPerRow;
  const int column = lane % kWordsPerRow * 8;
  const int step = kRowsPerPass * heads * D;
  T* dst = out + ((static_cast<size_t>(b) * tokens + n0 + row) * heads + h) * D + column;
#pragma unroll
  for (int pass = 0; pass < 16 / kRowsPerPass; ++pass) {
    const int r = row + pass * kRowsPerPass;
    if (r < valid) {
      *reinterpret_cast<uint4*>(dst + pass * step) =
          *reinterpret_cast<const uint4*>(tile + r * ld + column);
    }
  }
}

// The D x D (+ one column) state products of a pass: S = phi(K)^T [V, 1] (states) and
// dS' = phi(Q)^T [dnum, dden] (query). The right operand is a tile of ld D + 24 whose column D
// holds the extra column (ones or dden) and columns D + 1 .. D + 15 zeros, so the extra column
// is one more 16-wide product. Each warp owns the columns `col_tiles` tiles wide from
// `group * col_tiles` of the 16 rows `row_tile` of the state; group 0 also the extra column.
template <int D>
struct StateSlices {
  static constexpr int ld_extra = D + 24;
  static constexpr int row_tiles = D / 16;
  static constexpr int groups = 4 / row_tiles;          // warps sharing a row tile
  static constexpr int col_tiles = row_tiles / groups;  // column tiles per warp
  __device__ static int row_tile() { return static_cast<int>(threadIdx.x / 32) % row_tiles; }
  __device__ static int group() { return static_cast<int>(threadIdx.x / 32) / row_tiles; }
};

// acc += phi^T X and extra += phi^T X[:, D : D + 16] over the tile's first `rows` rows (a
// multiple of 16; rows past the valid ones zero in both tiles). phi: ld D + 8; X: ld LdX (a tile
// of ld D + 8 keeps only column D of the extra part in its rows: columns D + 8 .. D + 15 are
// the next row's first, so only extra's column 0 means anything then).
template <typename E, int D, int LdX = StateSlices<D>::ld_extra>
__device__ __forceinline__ void accumulate_state(
    TileAccumulator (&acc)[1][StateSlices<D>::col_tiles], TileAccumulator& extra, const E* phi,
    const E* x, int rows) {
  using S = StateSlices<D>;
  const int row_tile = S::row_tile(), group = S::group();
  wmma_tiles::mma_block<E, true, false, 1, S::col_tiles>(acc, phi, D + 8, x, LdX, row_tile,
                                                         group * S::col_tiles, rows);
  if (group == 0) {
    wmma_tiles::mma_tile<E, true, false>(extra, phi, D + 8, x, LdX, row_tile, D / 16, rows);
  }
}

// How a CTA's state slice reaches global memory (write_state).
enum class StateWrite {
  store,        // one CTA owns the state
  add_scalar,   // chunks share it: one atomic add per element (MHLA_SCALAR_STATE_ADDS=1, A/B)
  add_vector4,  // chunks share it: 4-wide adds (red.global.add.v4.f32, sm_90)
};

// The warp's slice of the state (D x D then the extra column as the last D floats) into fp32
// global memory: stored when one CTA owns the state, added when chunks share it. The 4-wide adds
// cut the atomic operations per state to a quarter: linear attention at N = 16,384 has 64 chunks
// adding into each head's state. For them lane pairs (l, l ^ 1) swap half their accumulators,
// so the even lane holds columns c..c+3 of row r and the odd lane those of row r + 8.
template <int D>
__device__ __forceinline__ void write_state(
    const TileAccumulator (&acc)[1][StateSlices<D>::col_tiles], const TileAccumulator& extra,
    float* state, StateWrite how) {
  using S = StateSlices<D>;
  const int row_tile = S::row_tile(), group = S::group();
  const int lane = static_cast<int>(threadIdx.x % 32);
  const bool odd = lane & 1;
#pragma unroll
  for (int j = 0; j < S::col_tiles; ++j) {
    float* dst = state + row_tile * 16 * D + (group * S::col_tiles + j) * 16;
    if (how == StateWrite::store) {
      acc[0][j].store(dst, D);
    } else if (how == StateWrite::add_vector4) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float* x = acc[0][j].x[h];
        // Even lanes give away row r + 8 (i = 2, 3), odd lanes row r (i = 0, 1).
        const float give0 = odd ? x[0] : x[2], give1 = odd ? x[1] : x[3];
        const float got0 = __shfl_xor_sync(0xffffffffu, give0, 1);
        const float got1 = __shfl_xor_sync(0xffffffffu, give1, 1);
        const float4 four =
            odd ? make_float4(got0, got1, x[2], x[3]) : make_float4(x[0], x[1], got0, got1);
        const int row = TileAccumulator::row(odd ? 2 : 0);
        const int col = TileAccumulator::col(h, 0) - (odd ? 2 : 0);  // a multiple of 4
        atomicAdd(reinterpret_cast<float4*>(dst + row * D + col), four);
      }
    } else {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          atomicAdd(dst + TileAccumulator::row(i) * D + TileAccumulator::col(h, i),
                    acc[0][j].x[h][i]);
        }
      }
    }
  }
  if (group == 0 && lane % 4 == 0) {  // column 0 of the extra tile: rows lane / 4 and + 8
    const int d = row_tile * 16 + lane / 4;
    if (how != StateWrite::store) {
      atomicAdd(state + D * D + d, extra.x[0][0]);
      atomicAdd(state + D * D + d + 8, extra.x[0][2]);
    } else {
      state[D * D + d] = extra.x[0][0];
      state[D * D + d + 8] = extra.x[0][2];
    }
  }
}

// How the passes of `chunks` chunks per block write their states (see StateWrite).
__device__ __forceinline__ StateWrite state_write(int chunks, bool scalar_adds) {
  if (chunks <= 1) return StateWrite::store;
  return scalar_adds ? StateWrite::add_scalar : StateWrite::add_vector4;
}

// A packed state (block_linear_attention.h, packed_states): D x D bf16, then D fp32 z; sizes in
// floats.
template <int D>
struct PackedState {
  static constexpr int z = D * D / 2;  // where z begins
  static constexpr int floats = z + D;
};

// The warp's slice of the state into a packed state (PackedState), for a state one CTA owns (no
// atomics).
// With `staging` (16 rows of shared memory that only this warp touches, row stride ld) the
// matrix slice goes there first and leaves in 16-byte stores, each 32-byte sector written whole
// by one instruction; stored straight from the accumulators, every instruction wrote eight half
// sectors (bf16 pairs of eight rows), which L2 merges at twice the requests (session 28).
template <int D>
__device__ __forceinline__ void write_packed_state(
    const TileAccumulator (&acc)[1][StateSlices<D>::col_tiles], const TileAccumulator& extra,
    float* state, __nv_bfloat16* staging = nullptr, int ld = 0) {
  using S = StateSlices<D>;
  constexpr int kCols = S::col_tiles * 16, kWordsPerRow = kCols / 8;
  const int row_tile = S::row_tile(), group = S::group();
  const int lane = static_cast<int>(threadIdx.x % 32);
  __nv_bfloat16* matrix = reinterpret_cast<__nv_bfloat16*>(state);
  __nv_bfloat16* slice = matrix + row_tile * 16 * D + group * kCols;
  if (staging == nullptr) {
#pragma unroll
    for (int j = 0; j < S::col_tiles; ++j) acc[0][j].store(slice + j * 16, D);
  } else {
#pragma unroll
    for (int j = 0; j < S::col_tiles; ++j) acc[0][j].store(staging + j * 16, ld);
    __syncwarp();
#pragma unroll
    for (int c = lane; c < 16 * kWordsPerRow; c += 32) {
      const int r = c / kWordsPerRow, word = c % kWordsPerRow;
      *reinterpret_cast<uint4*>(slice + r * D + word * 8) =
          *reinterpret_cast<const uint4*>(staging + r * ld + word * 8);
    }
  }
  if (group == 0 && lane % 4 == 0) {  // column 0 of the extra tile: rows lane / 4 and + 8
    const int d = row_tile * 16 + lane / 4;
    state[PackedState<D>::z + d] = extra.x[0][0];
    state[PackedState<D>::z + d + 8] = extra.x[0][2];
  }
}

// A state of a packed set (block_linear_attention.h: D * D bf16, then D fp32) into shared memory:
// the matrix rows into s (row stride D + 8), z into its fp32 array. Every load is issued before
// any store. The CTA's threads share it; a barrier must follow.
template <int D>
__device__ __forceinline__ void load_packed_state(const float* state, __nv_bfloat16* s, float* z) {
  constexpr int kWordsPerRow = D / 8, kWords = D * kWordsPerRow;
  constexpr int kPerThread = (kWords + kFragmentThreads - 1) / kFragmentThreads;
  const uint4* src = reinterpret_cast<const uint4*>(state);
  uint4 words[kPerThread];
#pragma unroll
  for (int u = 0; u < kPerThread; ++u) {
    const int c = static_cast<int>(threadIdx.x) + u * kFragmentThreads;
    if (c < kWords) words[u] = __ldg(src + c);
  }
#pragma unroll
  for (int u = 0; u < kPerThread; ++u) {
    const int c = static_cast<int>(threadIdx.x) + u * kFragmentThreads;
    if (c < kWords) {
      *reinterpret_cast<uint4*>(s + (c / kWordsPerRow) * (D + 8) + (c % kWordsPerRow) * 8) =
          words[u];
    }
  }
  for (int e = static_cast<int>(threadIdx.x); e < D; e += kFragmentThreads)
    z[e] = state[PackedState<D>::z + e];
}

// S (and z) of one state for a pass: from a packed set when `packed` (bf16 T only: the host
// refuses packed sets for other inputs), else from fp32 (tiles::load_state).
template <typename T, int D>
__device__ __forceinline__ void load_any_state(const float* set, size_t state_index, bool packed,
                                               T* s, float* z) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    if (packed) {
      load_packed_state<D>(set + state_index * PackedState<D>::floats, s, z);
      return;
    }
  }
  tiles::load_state<T, D, kFragmentThreads>(set + state_index * (D * D + D), s, z);
}

// Columns D .. D + 15 of this lane's row of an extra-column tile: lane 0 of the pair writes
// the extra value and seven zeros, lane 1 eight zeros.
template <typename E, int D>
__device__ __forceinline__ void store_extra_column(E* tile, int row, float extra) {
  const int seg = lane_half();
  const float words[8] = {seg == 0 ? extra : 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  *reinterpret_cast<uint4*>(tile + row * StateSlices<D>::ld_extra + D + 8 * seg) =
      from_floats<E>(words);
}

// Columns D .. D + 15 of the warp's rows of an extra-column tile from accumulator form: the
// value of row accumulator_row(r) in column D, zeros elsewhere. Each lane of a quad writes one
// 16-byte word: lanes 0 and 1 row r = 0's two, lanes 2 and 3 row r = 1's.
// With Ld = D + 8 (a tile without room for 16 extra columns) only column D is written, by lanes
// 0 and 2 of the quad.
template <typename E, int D, int Ld = StateSlices<D>::ld_extra>
__device__ __forceinline__ void store_extra_columns(E* tile, const float (&extra)[2]) {
  const int part = static_cast<int>(threadIdx.x % 4), r = part / 2, word = part % 2;
  if constexpr (Ld < D + 16) {
    if (word == 0) tile[accumulator_row(r) * Ld + D] = from_float<E>(extra[r]);
  } else {
    const float words[8] = {word == 0 ? extra[r] : 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    *reinterpret_cast<uint4*>(tile + accumulator_row(r) * Ld + D + 8 * word) =
        from_floats<E>(words);
  }
}

}  // namespace fragment_rows
}  // namespace mhla_kernels
