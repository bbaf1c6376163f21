#pragma once
// The state mix backward inside the pipelined query pass (fragment_query_backward.cu), for
// bidirectional MHLA with 2 to 16 blocks of at most 64 tokens and D = 64:
//   dS_j   = sum_i m_ij dS'_i                 (packed out, for the key pass)
//   dm_ij  = sum <dS'_i, S_j>                  (matrix and normalizer parts; one part per
//                                              (batch, head), which the caller sums in order)
// Why here: as its own kernel (block_mix_backward.h) the mix read dS' back from DRAM and wrote dS
// for the key pass: 150 MB and 42 us of the 0.285 ms forward+backward at B = 64, N = 1,024,
// H = 6, M = 16 (session 41). Here the CTA of block r of a (batch, head) takes rows
// [r 64 / M, (r + 1) 64 / M) of all M states, reading those rows of every dS'_i from L2 (written
// a moment ago by the (batch, head)'s other CTAs), the same rows of S from the forward, and
// writing the same rows of every dS_j: each dS' element is read once, by one CTA. A counter per
// (batch, head) says when its M dS' are out; a CTA mixes an item's rows during its next item
// (after that item's step 3), so it rarely waits. Session 42 tried two other orders first: a
// 16-CTA cluster per (batch, head) with a cluster barrier per item (160 us against 78 + 42, the
// CTAs in lockstep and 448 of them resident instead of 528), and the CTA that writes the last dS'
// of a (batch, head) mixing all of it (the late CTAs took every mix and ran 500 us longer).
//
// Warp w of the four takes 16 / M of the CTA's rows, one at a time: row d of the M states of
// dS' (X, 16 x 64, rows past M zero; dz'_i[d] as bf16 high and low parts in columns 64 and 65)
// and of S (Y) go to two 16-row tiles in the stage's free shared memory; then dm += X Y^T
// (m16n8k16 products) plus dz'_i[d] z_j[d] in fp32, and dS(row d) = m^T X (A = m^T as bf16 high
// and low parts, B = X read transposed; columns 64 and 65 give dz_j[d]).
#include <cuda_bf16.h>

#include <cstdint>

#include "common/element_type.cuh"
#include "common/wmma_gemm.cuh"
#include "mhla/fragment_rows.cuh"

namespace mhla_kernels {
namespace query_state_mix {

using Element = __nv_bfloat16;
using wmma_tiles::detail::load_matrices;
using wmma_tiles::detail::mma16816;

constexpr int kD = 64, kMaxBlocks = 16;
// Tile rows 144 bytes apart: the rows of an ldmatrix fall in distinct bank quads; columns 64-71
// carry the normalizer (64, 65) and zeros.
constexpr int kLd = kD + 8;
constexpr int kTileElements = kMaxBlocks * kLd;  // one warp's 16-row tile
constexpr int kPacked = fragment_rows::PackedState<kD>::floats;
constexpr int kPackedZ = fragment_rows::PackedState<kD>::z;

// A (batch, head)'s count of dS' out: after a CTA barrier that follows every thread's stores of
// its dS', one thread adds with release semantics (covering the CTA's stores through the
// barrier); a CTA that waits for all M spins on one thread with acquire loads, then takes a CTA
// barrier before any thread reads them.
__device__ __forceinline__ void count_written(int* counter) {
  if (threadIdx.x == 0)
    asm volatile("red.release.gpu.global.add.s32 [%0], 1;\n" ::"l"(counter) : "memory");
}
__device__ __forceinline__ void wait_written(const int* counter, int target) {
  if (threadIdx.x != 0) return;
  int seen;
  while (true) {
    asm volatile("ld.acquire.gpu.global.s32 %0, [%1];\n" : "=r"(seen) : "l"(counter) : "memory");
    if (seen >= target) break;
    __nanosleep(64);
  }
}

// A = m^T (row j, column i = m_ij; zero past M) as bf16 high and low parts.
__device__ __forceinline__ void transposed_mixing(const float* m, int blocks, unsigned (&hi)[4],
                                                  unsigned (&lo)[4]) {
  const int lane = static_cast<int>(threadIdx.x % 32), g8 = lane / 4, c0 = 2 * (lane % 4);
#pragma unroll
  for (int f = 0; f < 4; ++f) {
    const int j = g8 + 8 * (f % 2), i = c0 + 8 * (f / 2);
    float w[2];
#pragma unroll
    for (int e = 0; e < 2; ++e)
      w[e] = j < blocks && i + e < blocks ? __ldg(m + (i + e) * blocks + j) : 0.f;
    hi[f] = pack_pair<Element>(w[0], w[1]);
    float h0, h1;
    unpack_pair<Element>(hi[f], h0, h1);
    lo[f] = pack_pair<Element>(w[0] - h0, w[1] - h1);
  }
}

// What row d takes from global memory: 16-byte pieces of row d of every dS'_i (x) and S_j (y),
// zero past M; lanes 0-15 dz'_i[d] (i = lane), lanes 16-31 z_j[d] (j = lane - 16). Loads at L2:
// dS' was written by other CTAs of this grid.
struct RowInputs {
  uint4 x[4], y[4];
  float v;
};

__device__ __forceinline__ void load_row_inputs(const float* grad_mixed, const float* states,
                                                int blocks, int d, RowInputs& in) {
  const int lane = static_cast<int>(threadIdx.x % 32), k = lane % 16;
#pragma unroll
  for (int u = 0; u < 4; ++u) {
    const int piece = lane + 32 * u, state = piece / 8, column = 8 * (piece % 8);
    in.x[u] = in.y[u] = make_uint4(0, 0, 0, 0);
    if (state < blocks) {
      const size_t at = static_cast<size_t>(state) * kPacked * 2 + d * kD + column;  // elements
      in.x[u] =
          __ldcg(reinterpret_cast<const uint4*>(reinterpret_cast<const Element*>(grad_mixed) + at));
      in.y[u] =
          __ldcg(reinterpret_cast<const uint4*>(reinterpret_cast<const Element*>(states) + at));
    }
  }
  const float* normalizers = lane < 16 ? grad_mixed : states;
  in.v = k < blocks ? __ldcg(normalizers + k * kPacked + kPackedZ + d) : 0.f;
}

// Row d of the set: dm += X Y^T + dz' z^T, dS(row d) = m^T X and dz(d) out to grad_states.
// x_tile, y_tile: the warp's two 16-row tiles.
__device__ __forceinline__ void mix_row(const RowInputs& in, float* grad_states, int blocks, int d,
                                        const unsigned (&m_hi)[4], const unsigned (&m_lo)[4],
                                        Element* x_tile, Element* y_tile, float (&dm)[2][4]) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int g8 = lane / 4, c0 = 2 * (lane % 4), quad = lane / 8, row8 = lane % 8;
  __syncwarp();  // the previous row's reads of the tiles are done
#pragma unroll
  for (int u = 0; u < 4; ++u) {
    const int piece = lane + 32 * u, at = (piece / 8) * kLd + 8 * (piece % 8);
    *reinterpret_cast<uint4*>(x_tile + at) = in.x[u];
    *reinterpret_cast<uint4*>(y_tile + at) = in.y[u];
  }
  const float v = in.v;
  if (lane < 16) {  // dz'_i[d] in columns 64 (high part) and 65 (low part) of X's row i
    const unsigned hi = pack_pair<Element>(v, 0.f);
    float h, unused;
    unpack_pair<Element>(hi, h, unused);
    *reinterpret_cast<unsigned*>(x_tile + lane * kLd + kD) = pack_pair<Element>(h, v - h);
  }
  __syncwarp();
  // dm += X Y^T over the row's 64 columns ...
#pragma unroll
  for (int kk = 0; kk < kD; kk += 16) {
    unsigned a[4], b[4];
    load_matrices<false>(a, x_tile + ((quad % 2) * 8 + row8) * kLd + kk + (quad / 2) * 8);
    load_matrices<false>(b, y_tile + ((quad / 2) * 8 + row8) * kLd + kk + (quad % 2) * 8);
    mma16816<Element>(dm[0], a, b[0], b[1]);
    mma16816<Element>(dm[1], a, b[2], b[3]);
  }
  // ... and dz'_i[d] z_j[d] in fp32.
  const float dz_lo = __shfl_sync(0xffffffffu, v, g8), dz_hi = __shfl_sync(0xffffffffu, v, g8 + 8);
#pragma unroll
  for (int n = 0; n < 2; ++n) {
    const float z0 = __shfl_sync(0xffffffffu, v, 16 + 8 * n + c0);
    const float z1 = __shfl_sync(0xffffffffu, v, 16 + 8 * n + c0 + 1);
    dm[n][0] = fmaf(dz_lo, z0, dm[n][0]);
    dm[n][1] = fmaf(dz_lo, z1, dm[n][1]);
    dm[n][2] = fmaf(dz_hi, z0, dm[n][2]);
    dm[n][3] = fmaf(dz_hi, z1, dm[n][3]);
  }
  // dS(row d) = m^T X over columns 0-71: B = X read transposed (rows i, eight columns a matrix).
  unsigned b[5][2];
#pragma unroll
  for (int pair = 0; pair < 2; ++pair) {
    unsigned four[4];
    load_matrices<true>(four, x_tile + ((quad % 2) * 8 + row8) * kLd + 8 * (2 * pair + quad / 2));
    b[2 * pair][0] = four[0], b[2 * pair][1] = four[1];
    b[2 * pair + 1][0] = four[2], b[2 * pair + 1][1] = four[3];
  }
  unsigned rest[4][4];
#pragma unroll
  for (int pair = 2; pair < 4; ++pair)
    load_matrices<true>(rest[pair - 2],
                        x_tile + ((quad % 2) * 8 + row8) * kLd + 8 * (2 * pair + quad / 2));
  unsigned normalizer[4];  // columns 64-71 (lanes 16-31 repeat the first matrices' rows)
  load_matrices<true>(normalizer, x_tile + ((quad % 2) * 8 + row8) * kLd + kD);
  __syncwarp();  // every lane's reads of X are done: its rows take dS
  auto product = [&](unsigned b0, unsigned b1, float(&out)[4]) {
    out[0] = out[1] = out[2] = out[3] = 0.f;
    mma16816<Element>(out, m_hi, b0, b1);
    mma16816<Element>(out, m_lo, b0, b1);
  };
  auto put = [&](int col, const float(&out)[4]) {
    *reinterpret_cast<unsigned*>(x_tile + g8 * kLd + col) = pack_pair<Element>(out[0], out[1]);
    *reinterpret_cast<unsigned*>(x_tile + (g8 + 8) * kLd + col) =
        pack_pair<Element>(out[2], out[3]);
  };
#pragma unroll
  for (int t = 0; t < 8; ++t) {
    float out[4];
    if (t < 4)
      product(b[t][0], b[t][1], out);
    else
      product(rest[(t - 4) / 2][2 * (t % 2)], rest[(t - 4) / 2][2 * (t % 2) + 1], out);
    put(8 * t + c0, out);
  }
  float dz[4];
  product(normalizer[0], normalizer[1], dz);
  __syncwarp();
#pragma unroll
  for (int u = 0; u < 4; ++u) {
    const int piece = lane + 32 * u, state = piece / 8, column = 8 * (piece % 8);
    if (state < blocks) {
      Element* matrix = reinterpret_cast<Element*>(grad_states + state * kPacked);
      *reinterpret_cast<uint4*>(matrix + d * kD + column) =
          *reinterpret_cast<const uint4*>(x_tile + state * kLd + column);
    }
  }
  if (c0 == 0) {  // columns 64 and 65 of rows g8 and g8 + 8: dz_j[d], high part plus low part
    if (g8 < blocks) grad_states[g8 * kPacked + kPackedZ + d] = dz[0] + dz[1];
    if (g8 + 8 < blocks) grad_states[(g8 + 8) * kPacked + kPackedZ + d] = dz[2] + dz[3];
  }
}

// The warp's `rows` rows from first_row, the first one's inputs already loaded (`first`); the
// sets from the (batch, head)'s block 0. dm: this warp's 16 x 16 sum, accumulator form, added to.
__device__ __forceinline__ void mix_rows(const RowInputs& first, const float* grad_mixed,
                                         const float* states, float* grad_states,
                                         const float* mixing, int blocks, int first_row, int rows,
                                         Element* x_tile, Element* y_tile, float (&dm)[2][4]) {
  unsigned m_hi[4], m_lo[4];
  transposed_mixing(mixing, blocks, m_hi, m_lo);
  mix_row(first, grad_states, blocks, first_row, m_hi, m_lo, x_tile, y_tile, dm);
  for (int r = 1; r < rows; ++r) {
    RowInputs in;
    load_row_inputs(grad_mixed, states, blocks, first_row + r, in);
    mix_row(in, grad_states, blocks, first_row + r, m_hi, m_lo, x_tile, y_tile, dm);
  }
}

// dm's 16 x 16 accumulator form into 256 floats (row i, column j at 16 i + j).
__device__ __forceinline__ void store_dm(const float (&dm)[2][4], float* out) {
  const int lane = static_cast<int>(threadIdx.x % 32), g8 = lane / 4, c0 = 2 * (lane % 4);
#pragma unroll
  for (int n = 0; n < 2; ++n) {
    out[g8 * 16 + 8 * n + c0] = dm[n][0];
    out[g8 * 16 + 8 * n + c0 + 1] = dm[n][1];
    out[(g8 + 8) * 16 + 8 * n + c0] = dm[n][2];
    out[(g8 + 8) * 16 + 8 * n + c0 + 1] = dm[n][3];
  }
}

}  // namespace query_state_mix
}  // namespace mhla_kernels
