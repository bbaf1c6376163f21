#pragma once
// The state mix backward inside the pipelined query pass (fragment_query_backward.cu), for
// bidirectional MHLA with 2 to 16 blocks of at most 64 tokens and D = 64:
//   dS_j   = sum_i m_ij dS'_i                 (packed out, for the key pass)
//   dm_ij  = sum <dS'_i, S_j>                  (matrix and normalizer parts; one part per
//                                              (batch, head), which the caller sums in order)
// Why here: as its own kernel (block_mix_backward.h) the mix read dS' back from DRAM and wrote dS
// for the key pass: 150 MB and 42 us of the 0.285 ms forward+backward at B = 64, N = 1,024,
// H = 6, M = 16 (session 41). In the query pass, the CTA that writes the last dS' of a (batch,
// head) (a counter per (batch, head)) reads all M of them back from L2 a moment later, mixes
// them and drops their lines from L2 (discard.global.L2), so dS' never goes to DRAM at all.
// The M CTAs of a (batch, head) need not wait for each other: one 16-CTA cluster per (batch,
// head) with a barrier per item ran the pass at 160 us against 78 + 42 (session 42, calls 1-3).
//
// The CTA's four warps take 16 rows d each: row d of the M states of dS' (X, 16 x 64, rows past
// M zero; dz'_i[d] as bf16 high and low parts in columns 64 and 65) and of S (Y) go to two
// 16-row tiles in the stage's free shared memory; then dm += X Y^T (m16n8k16 products) plus
// dz'_i[d] z_j[d] in fp32, and dS(row d) = m^T X (A = m^T as bf16 high and low parts, B = X read
// transposed; columns 64 and 65 give dz_j[d]). The next row's loads are issued before this
// row's products.
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
constexpr int kRowsPerWarp = kD / 4;
constexpr int kPacked = fragment_rows::PackedState<kD>::floats;
constexpr int kPackedZ = fragment_rows::PackedState<kD>::z;
constexpr int kLineBytes = 128, kStateLines = kPacked * 4 / kLineBytes;
static_assert(kPacked * 4 % kLineBytes == 0, "packed states are whole L2 lines");

// Drops the lines of `count` consecutive packed states from L2 without writing them back (their
// contents become undefined). The CTA's threads share the lines.
__device__ __forceinline__ void discard_states(const float* first, int count) {
  const char* base = reinterpret_cast<const char*>(first);
  for (int line = static_cast<int>(threadIdx.x); line < count * kStateLines;
       line += static_cast<int>(blockDim.x)) {
    asm volatile("discard.global.L2 [%0], 128;\n" ::"l"(base + line * kLineBytes) : "memory");
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

// The whole mix of one (batch, head), by one CTA of four warps: warp w rows 16 w .. 16 w + 15.
// grad_mixed, states, grad_states: the (batch, head)'s block 0 of the packed sets; x_tiles and
// y_tiles: four 16-row tiles each (the warps'); part: the (batch, head)'s M x M part of dm
// (the four warps' sums added in warp order through their y tiles). Ends with a CTA barrier.
__device__ __forceinline__ void mix_state_set(const float* grad_mixed, const float* states,
                                              float* grad_states, const float* mixing, int blocks,
                                              Element* x_tiles, Element* y_tiles, float* part) {
  const int warp = static_cast<int>(threadIdx.x / 32);
  Element* const x_tile = x_tiles + warp * kTileElements;
  Element* const y_tile = y_tiles + warp * kTileElements;
  unsigned m_hi[4], m_lo[4];
  transposed_mixing(mixing, blocks, m_hi, m_lo);
  float dm[2][4] = {};
  const int first = kRowsPerWarp * warp;
  RowInputs next;
  load_row_inputs(grad_mixed, states, blocks, first, next);
  for (int r = 0; r < kRowsPerWarp; ++r) {
    const RowInputs in = next;
    if (r + 1 < kRowsPerWarp) load_row_inputs(grad_mixed, states, blocks, first + r + 1, next);
    mix_row(in, grad_states, blocks, first + r, m_hi, m_lo, x_tile, y_tile, dm);
  }
  __syncwarp();
  const int lane = static_cast<int>(threadIdx.x % 32), g8 = lane / 4, c0 = 2 * (lane % 4);
  float* const sums = reinterpret_cast<float*>(y_tile);
#pragma unroll
  for (int n = 0; n < 2; ++n) {
    sums[g8 * 16 + 8 * n + c0] = dm[n][0];
    sums[g8 * 16 + 8 * n + c0 + 1] = dm[n][1];
    sums[(g8 + 8) * 16 + 8 * n + c0] = dm[n][2];
    sums[(g8 + 8) * 16 + 8 * n + c0 + 1] = dm[n][3];
  }
  __syncthreads();
  for (int e = static_cast<int>(threadIdx.x); e < kMaxBlocks * kMaxBlocks;
       e += static_cast<int>(blockDim.x)) {
    const int i = e / kMaxBlocks, j = e % kMaxBlocks;
    if (i >= blocks || j >= blocks) continue;
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < 4; ++w)
      sum += reinterpret_cast<const float*>(y_tiles + w * kTileElements)[e];
    part[i * blocks + j] = sum;
  }
  __syncthreads();  // the tiles' last reads, before the caller's next writes
}

}  // namespace query_state_mix
}  // namespace mhla_kernels
