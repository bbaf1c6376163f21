#pragma once
// The state mix backward inside the pipelined query pass (fragment_query_backward.cu), for
// bidirectional MHLA with M in {2, 4, 8, 16} blocks of at most 64 tokens and D = 64:
//   dS_j   = sum_i m_ij dS'_i                 (packed out, for the key pass)
//   dm_ij += <dS'_i, S_j>                      (matrix and normalizer parts, over batch and heads)
// Why here: as its own kernel (block_mix_backward.h) the mix read dS' back from DRAM and wrote dS
// for the key pass, 150 MB and 41 us of the 0.28 ms forward+backward at B = 64, N = 1,024,
// H = 6, M = 16 (session 41). The query pass's CTAs of one (batch, head) are the M CTAs of a
// thread-block cluster, one per block. Each writes its dS'_i as before; after one cluster
// barrier per item, CTA r takes rows [r 64 / M, (r + 1) 64 / M) of all M states: it reads those
// rows of every dS'_i back (from L2, written a moment ago), the same rows of S from the forward,
// and writes the same rows of every dS_j. So each dS' element is read once, by one CTA, and the
// separate kernel and its DRAM round trip of dS' are gone. Once every CTA of the cluster is
// past the next item's barrier, each discards its own dS' lines from L2 so they are never
// written back (discard.global.L2).
//
// Warp w of the four takes 16 / M of the CTA's rows, one at a time: row d of the M states of
// dS' (X, 16 x 64 with rows past M zero) and of S (Y) go to two 16-row tiles of the stage's
// free shared memory; then dm += X Y^T (m16n8k16 products, A = X, B = Y both as stored),
// dS(row d) = m^T X (A = m^T as bf16 high and low parts, B = X read transposed), the normalizer
// parts in fp32 by shuffles. dm's part of a CTA stays in two registers a thread (the four warps'
// sums added in warp order: deterministic), written once at the end as the CTA's part.
#include <cuda_bf16.h>

#include <cstdint>

#include "common/element_type.cuh"
#include "common/wmma_gemm.cuh"
#include "mhla/block_linear_attention.h"
#include "mhla/fragment_rows.cuh"

namespace mhla_kernels {
namespace query_state_mix {

using Element = __nv_bfloat16;
using wmma_tiles::detail::load_matrices;
using wmma_tiles::detail::mma16816;

constexpr int kD = 64, kMaxBlocks = 16;
constexpr int kLd = kD + 8;  // tile rows 144 bytes apart: ldmatrix rows in distinct bank quads
constexpr int kTileElements = kMaxBlocks * kLd;  // one warp's 16-row tile
constexpr int kPacked = fragment_rows::PackedState<kD>::floats,
              kPackedZ = fragment_rows::PackedState<kD>::z;
constexpr int kLineBytes = 128, kStateLines = kPacked * 4 / kLineBytes;
static_assert(kPacked * 4 % kLineBytes == 0, "packed states are whole L2 lines");

// The cluster barrier in two halves (every thread of every CTA, alternating): the writes before
// a thread's arrive (global included) are visible to the reads after any thread's wait.
__device__ __forceinline__ void cluster_arrive() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() {
  asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

// Drops a packed state's lines from L2 without writing them back (their contents become
// undefined): the CTA's threads share the lines.
__device__ __forceinline__ void discard_state(const float* state) {
  const int line = static_cast<int>(threadIdx.x);
  if (line < kStateLines) {
    const char* address = reinterpret_cast<const char*>(state) + line * kLineBytes;
    asm volatile("discard.global.L2 [%0], 128;\n" ::"l"(address) : "memory");
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

// Row d of the M states of a packed set (from `first`, the (batch, head)'s block 0), 16-byte
// pieces of states 0-15 (zero past M). Loads at L2: dS' was written by other CTAs of this grid.
__device__ __forceinline__ void load_rows(const float* first, int blocks, int d,
                                          uint4 (&words)[4]) {
  const int lane = static_cast<int>(threadIdx.x % 32);
#pragma unroll
  for (int u = 0; u < 4; ++u) {
    const int piece = lane + 32 * u, state = piece / 8, column = 8 * (piece % 8);
    words[u] = make_uint4(0, 0, 0, 0);
    if (state < blocks) {
      const Element* matrix = reinterpret_cast<const Element*>(first + state * kPacked);
      words[u] = __ldcg(reinterpret_cast<const uint4*>(matrix + d * kD + column));
    }
  }
}

__device__ __forceinline__ void store_rows(Element* tile, const uint4 (&words)[4]) {
  const int lane = static_cast<int>(threadIdx.x % 32);
#pragma unroll
  for (int u = 0; u < 4; ++u) {
    const int piece = lane + 32 * u;
    *reinterpret_cast<uint4*>(tile + (piece / 8) * kLd + 8 * (piece % 8)) = words[u];
  }
}

// What a warp's row d takes from global memory: row d of every dS'_i (x) and S_j (y); lanes
// 0-15 dz'_i[d] (i = lane), lanes 16-31 z_j[d] (j = lane - 16), zero past M. Loaded apart from
// the products so the kernel can issue them early.
struct RowInputs {
  uint4 x[4], y[4];
  float v;
};

__device__ __forceinline__ void load_row_inputs(const float* grad_mixed, const float* states,
                                                int blocks, int d, RowInputs& in) {
  const int lane = static_cast<int>(threadIdx.x % 32), k = lane % 16;
  load_rows(grad_mixed, blocks, d, in.x);
  load_rows(states, blocks, d, in.y);
  const float* normalizers = lane < 16 ? grad_mixed : states;
  in.v = k < blocks ? __ldcg(normalizers + k * kPacked + kPackedZ + d) : 0.f;
}

// Row d: dm += X Y^T (+ the normalizer part), dS(row d) = m^T X out to grad_states (the
// (batch, head)'s block 0 of the packed dS set). x_tile, y_tile: the warp's two 16-row tiles.
__device__ __forceinline__ void mix_row(const RowInputs& in, float* grad_states,
                                        const float* mixing, int blocks, int d,
                                        const unsigned (&m_hi)[4], const unsigned (&m_lo)[4],
                                        Element* x_tile, Element* y_tile, float (&dm)[2][4]) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int g8 = lane / 4, c0 = 2 * (lane % 4), quad = lane / 8, row8 = lane % 8;
  __syncwarp();  // the previous row's reads of the tiles are done
  store_rows(x_tile, in.x);
  store_rows(y_tile, in.y);
  __syncwarp();
  // dm += X Y^T over the row's 64 columns.
#pragma unroll
  for (int kk = 0; kk < kD; kk += 16) {
    unsigned a[4], b[4];
    load_matrices<false>(a, x_tile + ((quad % 2) * 8 + row8) * kLd + kk + (quad / 2) * 8);
    load_matrices<false>(b, y_tile + ((quad / 2) * 8 + row8) * kLd + kk + (quad % 2) * 8);
    mma16816<Element>(dm[0], a, b[0], b[1]);
    mma16816<Element>(dm[1], a, b[2], b[3]);
  }
  // ... and the normalizer part dz'_i[d] z_j[d] in fp32.
  const float v = in.v;
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
  // dS(row d) = m^T X: B = X read transposed (rows i, eight columns per matrix).
  unsigned b[4][4];
#pragma unroll
  for (int pair = 0; pair < 4; ++pair)
    load_matrices<true>(b[pair],
                        x_tile + ((quad % 2) * 8 + row8) * kLd + 8 * (2 * pair + quad / 2));
  // dz_j[d] = sum_i m_ij dz'_i[d] (lane j < M).
  float dz = 0.f;
  for (int i = 0; i < blocks; ++i) {
    const float dzi = __shfl_sync(0xffffffffu, v, i);
    if (lane < blocks) dz = fmaf(__ldg(mixing + i * blocks + lane), dzi, dz);
  }
  __syncwarp();  // every lane's reads of X are done: its rows take dS
#pragma unroll
  for (int pair = 0; pair < 4; ++pair) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      float out[4] = {};
      mma16816<Element>(out, m_hi, b[pair][2 * e], b[pair][2 * e + 1]);
      mma16816<Element>(out, m_lo, b[pair][2 * e], b[pair][2 * e + 1]);
      const int col = 8 * (2 * pair + e) + c0;
      *reinterpret_cast<unsigned*>(x_tile + g8 * kLd + col) = pack_pair<Element>(out[0], out[1]);
      *reinterpret_cast<unsigned*>(x_tile + (g8 + 8) * kLd + col) =
          pack_pair<Element>(out[2], out[3]);
    }
  }
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
  if (lane < blocks) grad_states[lane * kPacked + kPackedZ + d] = dz;
}

// The warp's `rows` rows from first_row, the first one's inputs already loaded (`first`); the
// sets from the (batch, head)'s block 0. dm: this warp's 16 x 16 sum, accumulator form, added to.
__device__ __forceinline__ void mix_rows(const RowInputs& first, const float* grad_mixed,
                                         const float* states, float* grad_states,
                                         const float* mixing, int blocks, int first_row, int rows,
                                         Element* x_tile, Element* y_tile, float (&dm)[2][4]) {
  unsigned m_hi[4], m_lo[4];
  transposed_mixing(mixing, blocks, m_hi, m_lo);
  mix_row(first, grad_states, mixing, blocks, first_row, m_hi, m_lo, x_tile, y_tile, dm);
  for (int r = 1; r < rows; ++r) {
    RowInputs in;
    load_row_inputs(grad_mixed, states, blocks, first_row + r, in);
    mix_row(in, grad_states, mixing, blocks, first_row + r, m_hi, m_lo, x_tile, y_tile, dm);
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
