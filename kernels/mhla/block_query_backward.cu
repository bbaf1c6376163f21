// The query pass of the bidirectional block-linear backward on mma.sync fragments (see
// block_query_backward.h). One CTA of four warps per (batch*head, block, chunk); each warp owns
// 16 rows of every 64-token tile. Per tile:
//   1. rows: two lanes per row hold its q, dO and o (loaded one tile ahead, in registers), sum
//      q^2, den = phi(q) . z' + eps and dO . o over the pair; phi(q) and dnum = dO / den go to
//      shared memory (dden = -(dO . o) / den as column D of dnum), the raw q rows too;
//   2. own rows: d(phi) = dnum S'^T on mma.sync, then the feature backward in the accumulators'
//      layout (q read back by ldmatrix in the same layout) and dq out through shared memory;
//   3. after the tile's one barrier: dS' += phi(Q)^T [dnum, dden] over all 64 rows, each warp a
//      16-row slice of dS' in registers until the chunk ends.
// phi and dnum tiles are double-buffered, so a warp can start the next tile while others finish
// step 3.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdlib>

#include "common/wmma_gemm.cuh"
#include "mhla/block_query_backward.h"
#include "mhla/block_work.cuh"
#include "mhla/state_tiles.cuh"
#include "mhla/tiles.cuh"

namespace mhla_kernels {
namespace {

using namespace tiles;
using wmma_tiles::TileAccumulator;
namespace mma = wmma_tiles::detail;

constexpr int kQueryThreads = 128;

template <int D>
struct QueryLayout {
  static constexpr int ld = D + 8;        // S', phi(Q) and raw q rows (elements)
  static constexpr int ldn = D + 24;      // dnum; column D holds dden, D + 1 .. D + 15 zero
  static constexpr int half = D / 2;      // elements of a row per lane
  static constexpr int words = half / 8;  // 16-byte words of a row per lane
  static constexpr int row_tiles = D / 16;                 // of dS'
  static constexpr int groups = 4 / row_tiles;             // warps sharing a row tile of dS'
  static constexpr int col_tiles = row_tiles / groups;     // dS' column tiles per warp
  static constexpr int state = D * D + D;
};

template <int D>
constexpr size_t query_smem() {
  using Q = QueryLayout<D>;
  return align128(D * Q::ld * 2) + 2 * align128(kTile * Q::ld * 2) +
         2 * align128(kTile * Q::ldn * 2) + align128(kTile * Q::ld * 2) + align128(D * 4) +
         2 * align128(kTile * 4);
}

template <typename E>
__device__ __forceinline__ void to_floats(const uint4& word, float (&x)[8]) {
  const E* e = reinterpret_cast<const E*>(&word);
#pragma unroll
  for (int i = 0; i < 8; ++i) x[i] = to_float(e[i]);
}

template <typename E>
__device__ __forceinline__ uint4 from_floats(const float (&x)[8]) {
  uint4 word;
  E* e = reinterpret_cast<E*>(&word);
#pragma unroll
  for (int i = 0; i < 8; ++i) e[i] = from_float<E>(x[i]);
  return word;
}

template <typename E>
__device__ __forceinline__ void unpack_pair(unsigned bits, float& a, float& b) {
  const E* e = reinterpret_cast<const E*>(&bits);
  a = to_float(e[0]);
  b = to_float(e[1]);
}

template <typename E>
__device__ __forceinline__ unsigned pack_pair(float a, float b) {
  unsigned bits;
  E* e = reinterpret_cast<E*>(&bits);
  e[0] = from_float<E>(a);
  e[1] = from_float<E>(b);
  return bits;
}

template <typename T, int D>
__global__ void __launch_bounds__(kQueryThreads, 3)
    fragment_query_backward_kernel(BlockLinearBackward p, int chunks) {
  using Q = QueryLayout<D>;
  using E = T;
  extern __shared__ __align__(128) unsigned char smem[];
  unsigned char* cursor = smem;
  auto take = [&](size_t bytes) {
    unsigned char* at = cursor;
    cursor += align128(bytes);
    return at;
  };
  E* mixed = reinterpret_cast<E*>(take(D * Q::ld * 2));  // S' [d][c]
  E* phi_tiles = reinterpret_cast<E*>(take(2 * align128(kTile * Q::ld * 2)));
  E* dnum_tiles = reinterpret_cast<E*>(take(2 * align128(kTile * Q::ldn * 2)));
  E* q_raw = reinterpret_cast<E*>(take(kTile * Q::ld * 2));  // then dq, per warp's rows
  float* z = reinterpret_cast<float*>(take(D * 4));
  float* dden_rows = reinterpret_cast<float*>(take(kTile * 4));
  float* scale_rows = reinterpret_cast<float*>(take(kTile * 4));
  constexpr int kPhiStride = static_cast<int>(align128(kTile * Q::ld * 2) / 2);
  constexpr int kDnumStride = static_cast<int>(align128(kTile * Q::ldn * 2) / 2);

  const Work w = work_of(p.shape, chunks);
  const size_t state_offset = (static_cast<size_t>(w.bh) * p.shape.blocks + w.block) * Q::state;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int row = warp * 16 + lane / 2, seg = lane % 2;  // step 1: this lane's row and half

  uint4 raw_q[Q::words], raw_g[Q::words], raw_o[Q::words];
  auto issue = [&](int n0) {
    const bool live = row < w.end - n0;
#pragma unroll
    for (int u = 0; u < Q::words; ++u) {
      raw_q[u] = raw_g[u] = raw_o[u] = make_uint4(0u, 0u, 0u, 0u);
    }
    if (!live) return;
    const T* q = token_row<T, D>(p.q, w.b, n0 + row, w.h) + seg * Q::half;
    const T* g = token_row<T, D>(p.grad_out, w.b, n0 + row, w.h) + seg * Q::half;
    const T* o = token_row<T, D>(p.out, w.b, n0 + row, w.h) + seg * Q::half;
#pragma unroll
    for (int u = 0; u < Q::words; ++u) {
      raw_q[u] = *reinterpret_cast<const uint4*>(q + u * 8);
      raw_g[u] = *reinterpret_cast<const uint4*>(g + u * 8);
      raw_o[u] = *reinterpret_cast<const uint4*>(o + u * 8);
    }
  };
  if (w.begin < w.end) issue(w.begin);
  load_state<T, D, kQueryThreads>(p.mixed + state_offset, mixed, z);
  __syncthreads();

  const int row_tile = warp % Q::row_tiles, group = warp / Q::row_tiles;
  TileAccumulator dstate[1][Q::col_tiles], dz;
#pragma unroll
  for (int j = 0; j < Q::col_tiles; ++j) dstate[0][j].zero();
  dz.zero();
  T* grad_q = static_cast<T*>(p.grad_q);
  int buffer = 0;
  for (int n0 = w.begin; n0 < w.end; n0 += kTile, buffer ^= 1) {
    const int valid = min(kTile, w.end - n0), rows = (valid + 15) / 16 * 16;
    E* phi = phi_tiles + buffer * kPhiStride;
    E* dnum = dnum_tiles + buffer * kDnumStride;
    // 1. This lane's half of its row.
    {
      const bool live = row < valid;
      float squares = 0.f;
#pragma unroll
      for (int u = 0; u < Q::words; ++u) {
        float x[8];
        to_floats<E>(raw_q[u], x);
#pragma unroll
        for (int i = 0; i < 8; ++i) squares += x[i] * x[i];
      }
      squares += __shfl_xor_sync(0xffffffffu, squares, 1);
      const float scale = rsqrtf(squares / D + kNormEps);
      float den = 0.f, g_dot_o = 0.f;
#pragma unroll
      for (int u = 0; u < Q::words; ++u) {
        const int d0 = seg * Q::half + u * 8;
        float x[8], g[8], o[8];
        to_floats<E>(raw_q[u], x);
        to_floats<E>(raw_g[u], g);
        to_floats<E>(raw_o[u], o);
        const float4 z0 = *reinterpret_cast<const float4*>(z + d0);
        const float4 z1 = *reinterpret_cast<const float4*>(z + d0 + 4);
        const float zs[8] = {z0.x, z0.y, z0.z, z0.w, z1.x, z1.y, z1.z, z1.w};
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          x[i] = live ? fmaxf(x[i] * scale, 0.f) + kFeatureFloor : 0.f;
          x[i] = to_float(from_float<E>(x[i]));  // den from phi as the products see it
          den += x[i] * zs[i];
          g_dot_o += g[i] * o[i];
        }
        *reinterpret_cast<uint4*>(phi + row * Q::ld + d0) = from_floats<E>(x);
        *reinterpret_cast<uint4*>(q_raw + row * Q::ld + d0) = raw_q[u];
      }
      den += __shfl_xor_sync(0xffffffffu, den, 1);
      g_dot_o += __shfl_xor_sync(0xffffffffu, g_dot_o, 1);
      const float inv = live ? 1.f / (den + kDenominatorEps) : 0.f;
      const float dden = -g_dot_o * inv;
#pragma unroll
      for (int u = 0; u < Q::words; ++u) {
        float g[8];
        to_floats<E>(raw_g[u], g);
#pragma unroll
        for (int i = 0; i < 8; ++i) g[i] *= inv;
        *reinterpret_cast<uint4*>(dnum + row * Q::ldn + seg * Q::half + u * 8) = from_floats<E>(g);
      }
      if (seg == 0) {
        float extra[8] = {dden, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        *reinterpret_cast<uint4*>(dnum + row * Q::ldn + D) = from_floats<E>(extra);
        dden_rows[row] = dden;
        scale_rows[row] = scale;
      } else {
        *reinterpret_cast<uint4*>(dnum + row * Q::ldn + D + 8) = make_uint4(0u, 0u, 0u, 0u);
      }
    }
    if (n0 + kTile < w.end) issue(n0 + kTile);  // in flight through steps 2 and 3
    __syncwarp();
    // 2. d(phi) of the warp's rows, the feature backward, dq.
    if (warp * 16 < valid) {
      TileAccumulator dphi[1][D / 16];
#pragma unroll
      for (int j = 0; j < D / 16; ++j) dphi[0][j].zero();
      wmma_tiles::mma_block<E, false, true, 1, D / 16>(dphi, dnum, Q::ldn, mixed, Q::ld, warp, 0,
                                                        D);
      const int quad = lane / 8, row8 = lane % 8;
      unsigned qf[D / 16][4];
#pragma unroll
      for (int j = 0; j < D / 16; ++j) {
        mma::load_matrices<false>(
            qf[j], q_raw + (warp * 16 + (quad % 2) * 8 + row8) * Q::ld + j * 16 + (quad / 2) * 8);
      }
      // This lane's rows r0 = lane / 4 and r0 + 8 of the warp's 16; the columns of each tile j
      // are j * 16 + h * 8 + 2 (lane % 4) + {0, 1} (TileAccumulator's layout).
      const int r0 = warp * 16 + lane / 4;
      const float scale[2] = {scale_rows[r0], scale_rows[r0 + 8]};
      const float dden[2] = {dden_rows[r0], dden_rows[r0 + 8]};
      float dot[2] = {0.f, 0.f};
#pragma unroll
      for (int j = 0; j < D / 16; ++j) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int c = j * 16 + h * 8 + (lane % 4) * 2;
          const float2 zc = *reinterpret_cast<const float2*>(z + c);
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            float x0, x1;
            unpack_pair<E>(qf[j][h * 2 + r], x0, x1);
            const float y0 = x0 * scale[r], y1 = x1 * scale[r];
            float& g0 = dphi[0][j].x[h][2 * r];
            float& g1 = dphi[0][j].x[h][2 * r + 1];
            g0 = y0 > 0.f ? g0 + dden[r] * zc.x : 0.f;
            g1 = y1 > 0.f ? g1 + dden[r] * zc.y : 0.f;
            dot[r] += g0 * y0 + g1 * y1;
          }
        }
      }
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        dot[r] += __shfl_xor_sync(0xffffffffu, dot[r], 1);
        dot[r] += __shfl_xor_sync(0xffffffffu, dot[r], 2);
        dot[r] /= D;
      }
      __syncwarp();  // every lane's ldmatrix of q_raw is done: dq overwrites it
#pragma unroll
      for (int j = 0; j < D / 16; ++j) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int c = j * 16 + h * 8 + (lane % 4) * 2;
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            float x0, x1;
            unpack_pair<E>(qf[j][h * 2 + r], x0, x1);
            const float y0 = x0 * scale[r], y1 = x1 * scale[r];
            const float dq0 = scale[r] * (dphi[0][j].x[h][2 * r] - y0 * dot[r]);
            const float dq1 = scale[r] * (dphi[0][j].x[h][2 * r + 1] - y1 * dot[r]);
            *reinterpret_cast<unsigned*>(q_raw + (r0 + 8 * r) * Q::ld + c) = pack_pair<E>(dq0, dq1);
          }
        }
      }
      __syncwarp();
      constexpr int kWordsPerRow = D / 8;
#pragma unroll
      for (int c = lane; c < 16 * kWordsPerRow; c += 32) {
        const int r = c / kWordsPerRow, x = c % kWordsPerRow;
        if (warp * 16 + r < valid) {
          const size_t at =
              ((static_cast<size_t>(w.b) * p.shape.tokens + n0 + warp * 16 + r) * p.shape.heads +
               w.h) *
                  D +
              x * 8;
          *reinterpret_cast<uint4*>(grad_q + at) =
              *reinterpret_cast<const uint4*>(q_raw + (warp * 16 + r) * Q::ld + x * 8);
        }
      }
    }
    __syncthreads();  // phi and dnum of all rows are in
    // 3. dS' += phi(Q)^T dnum and dz' += phi(Q)^T dden over the tile.
    wmma_tiles::mma_block<E, true, false, 1, Q::col_tiles>(dstate, phi, Q::ld, dnum, Q::ldn,
                                                           row_tile, group * Q::col_tiles, rows);
    if (group == 0) {
      wmma_tiles::mma_tile<E, true, false>(dz, phi, Q::ld, dnum, Q::ldn, row_tile, D / 16, rows);
    }
  }
  float* out = p.grad_mixed + state_offset;
  const bool atomic = chunks > 1;
#pragma unroll
  for (int j = 0; j < Q::col_tiles; ++j) {
    float* dst = out + row_tile * 16 * D + (group * Q::col_tiles + j) * 16;
    if (!atomic) {
      dstate[0][j].store(dst, D);
    } else {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          atomicAdd(dst + TileAccumulator::row(i) * D + TileAccumulator::col(h, i),
                    dstate[0][j].x[h][i]);
        }
      }
    }
  }
  if (group == 0 && lane % 4 == 0) {  // column 0 of the dden tile: dz' of rows lane / 4, + 8
    const int d = row_tile * 16 + lane / 4;
    if (atomic) {
      atomicAdd(out + D * D + d, dz.x[0][0]);
      atomicAdd(out + D * D + d + 8, dz.x[0][2]);
    } else {
      out[D * D + d] = dz.x[0][0];
      out[D * D + d + 8] = dz.x[0][2];
    }
  }
}

template <typename T, int D>
cudaError_t launch(const BlockLinearBackward& a, int chunks, cudaStream_t stream) {
  constexpr size_t bytes = query_smem<D>();
  static const cudaError_t opted = allow_smem(fragment_query_backward_kernel<T, D>, bytes);
  if (opted != cudaSuccess) return opted;
  const dim3 grid(a.shape.blocks * chunks, a.shape.batch * a.shape.heads);
  fragment_query_backward_kernel<T, D><<<grid, kQueryThreads, bytes, stream>>>(a, chunks);
  return cudaGetLastError();
}

}  // namespace

bool fragment_query_backward_supported(DType dtype, int head_dim) {
  return (dtype == DType::bf16 || dtype == DType::f16) && (head_dim == 32 || head_dim == 64);
}

cudaError_t fragment_query_backward(const BlockLinearBackward& a, int chunks,
                                    cudaStream_t stream) {
  if (!fragment_query_backward_supported(a.dtype, a.shape.head_dim) || chunks < 1)
    return cudaErrorInvalidValue;
  const bool bf16 = a.dtype == DType::bf16;
  if (a.shape.head_dim == 64) {
    return bf16 ? launch<__nv_bfloat16, 64>(a, chunks, stream)
                : launch<__half, 64>(a, chunks, stream);
  }
  return bf16 ? launch<__nv_bfloat16, 32>(a, chunks, stream)
              : launch<__half, 32>(a, chunks, stream);
}

}  // namespace mhla_kernels
