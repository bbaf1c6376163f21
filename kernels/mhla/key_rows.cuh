#pragma once
// The key side of the bidirectional block-linear backward for one warp's 16 rows of a 64-token
// tile, on mma.sync fragments (fragment_rows.cuh's two forms): the key pass
// (fragment_key_backward.cu) and the sequence key backward (sequence_key_backward.cu) share it.
// The warp needs phi(k), the raw k and v rows in its rows of three shared tiles, the row scales
// 1/rms(k), and dS_j (D x D, row stride D + 8) and dz_j in shared memory; it touches no other
// warp's rows.
#include "common/wmma_gemm.cuh"
#include "mhla/fragment_rows.cuh"

namespace mhla_kernels {
namespace key_rows {

using fragment_rows::accumulator_row;
using fragment_rows::copy_rows_out;
using fragment_rows::feature_backward;
using fragment_rows::store_rows;
using wmma_tiles::TileAccumulator;

template <int D>
constexpr int kLd = D + 8;  // elements per row of every tile (ldmatrix without bank conflicts)

// Step 2 of a tile for the warp's rows (some valid), in two parts around the chunk form's
// barrier (every read of dS and dz is in the first):
//   key_products: dv = phi(K) dS, out through the warp's rows of phi, then d(phi) = V dS^T + dz
//     (the normalizer's term, the same for every row), one product after the other so that only
//     one set of accumulators is live (the chunk form then fits four CTAs' 128 registers at
//     D = 64 without spills; with both products live the passes took 160-168);
//   key_rows_out: the feature backward, dk and dv out.
template <typename E, int D>
__device__ __forceinline__ void key_products(TileAccumulator (&dphi)[1][D / 16], E* phi,
                                             const E* v_raw, const E* dstate, const float* dz) {
  constexpr int ld = kLd<D>;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const float ones[2] = {1.f, 1.f};
  {
    TileAccumulator dv[1][D / 16];
#pragma unroll
    for (int j = 0; j < D / 16; ++j) dv[0][j].zero();
    wmma_tiles::mma_block<E, false, false, 1, D / 16>(dv, phi, ld, dstate, ld, warp, 0, D);
    __syncwarp();  // the warp's reads of phi are done: dv goes there
    store_rows<E, D>(dv, ones, phi, ld);
  }
#pragma unroll
  for (int j = 0; j < D / 16; ++j) dphi[0][j].zero();
  wmma_tiles::mma_block<E, false, true, 1, D / 16>(dphi, v_raw, ld, dstate, ld, warp, 0, D);
#pragma unroll
  for (int j = 0; j < D / 16; ++j) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float2 add = *reinterpret_cast<const float2*>(dz + j * 16 + h * 8 + (lane % 4) * 2);
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        dphi[0][j].x[h][2 * r] += add.x;
        dphi[0][j].x[h][2 * r + 1] += add.y;
      }
    }
  }
}

// dk and dv go to contiguous [B, N, H, D] tensors of `tokens` tokens and `heads` heads, the
// warp's rows at token n0 + (tile row) of (b, h), rows at or past `valid` (tile rows) left out.
template <typename E, int D>
__device__ __forceinline__ void key_rows_out(TileAccumulator (&dphi)[1][D / 16], const E* phi,
                                             E* k_raw, const float* scale_rows, E* grad_k,
                                             E* grad_v, int tokens, int heads, int b, int h,
                                             int n0, int valid) {
  constexpr int ld = kLd<D>;
  const float unused[2] = {0.f, 0.f};
  const float scale[2] = {scale_rows[accumulator_row(0)], scale_rows[accumulator_row(1)]};
  feature_backward<E, D, false>(dphi, k_raw, k_raw, ld, scale, unused, nullptr);
  __syncwarp();
  copy_rows_out<E, D>(phi, ld, grad_v, tokens, heads, b, h, n0, valid);
  copy_rows_out<E, D>(k_raw, ld, grad_k, tokens, heads, b, h, n0, valid);
}

}  // namespace key_rows
}  // namespace mhla_kernels
