// G_ij += sum X_i * Y_j over batch*head and state elements (see block_pair_products.h), on tensor
// cores: each item's rows go to shared memory as two bf16 parts (x = hi + lo, lo the bf16 rounding
// of x - hi), and G += Xh Yh^T + Xh Yl^T + Xl Yh^T by mma.sync with fp32 accumulation: about 2^-17
// relative per term (the dropped Xl Yl^T and lo's own rounding). The SIMT kernel this replaces
// was bound by its shared-memory reads (one per two FMAs).
#include <algorithm>
#include <cstdlib>

#include "common/device_info.h"
#include "common/packed_access.cuh"
#include "common/wmma_gemm.cuh"
#include "mhla/block_pair_products.h"

namespace mhla_kernels {
namespace {

using wmma_tiles::TileAccumulator;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kColumns = 128;      // state elements per item: the product depth of one item
constexpr int kLd = kColumns + 8;  // bf16 rows: 16-byte aligned, ldmatrix without bank conflicts
constexpr int kMaxRows = 64;
constexpr int kQuads = kColumns / 4;  // groups of four elements per row of an item

__host__ __device__ constexpr int padded_rows(int rows) {
  return (rows + 15) / 16 * 16;
}

constexpr int kParts = 2;  // hi, lo

// 2 x kParts bf16 tiles [padded][kLd] (the parts of X, then of Y); the final reduction reuses them
// as fp32 [padded][padded].
size_t shared_bytes(int rows) {
  const size_t tiles = 2 * kParts * static_cast<size_t>(padded_rows(rows)) * kLd * 2;
  return std::max<size_t>(tiles, kMaxRows * kMaxRows * sizeof(float));
}

__global__ void __launch_bounds__(kThreads) pair_products_kernel(BlockPairProducts p) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int padded = padded_rows(p.rows), side = padded / 16, units = side * side;
  __nv_bfloat16* tiles = reinterpret_cast<__nv_bfloat16*>(smem);
  auto part = [&](int which, int a) { return tiles + (which * kParts + a) * padded * kLd; };
  const int t = threadIdx.x, warp = t / 32;
  // This warp's 16 x 16 tiles of G: units warp, warp + kWarps, ... (at most two at 64 rows).
  constexpr int kUnits = (kMaxRows / 16) * (kMaxRows / 16) / kWarps;
  TileAccumulator acc[kUnits];
#pragma unroll
  for (int u = 0; u < kUnits; ++u) acc[u].zero();
  const int64_t columns = (p.elements + kColumns - 1) / kColumns;
  const int64_t items = static_cast<int64_t>(p.batch_heads) * columns;
  const int count = padded * kQuads;  // groups of four per set and item
  for (int64_t item = blockIdx.x; item < items; item += gridDim.x) {
    const int64_t bh = item / columns, e0 = (item % columns) * kColumns;
    const int64_t stride = p.elements - p.packed_matrix / 2;  // floats per block
    const size_t base = static_cast<size_t>(bh) * p.blocks * stride;
    __syncthreads();  // the previous item's products are done with the tiles
    // Every load of the item is issued before the first store (rows past p.rows and elements
    // past the end are zero).
    constexpr int kBatch = 8;
    for (int first = t; first < 2 * count; first += kBatch * kThreads) {
      float v[kBatch][4];
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int idx = first + u * kThreads;
        const int which = idx >= count, local = idx - which * count;
        const int r = local / kQuads, e = static_cast<int>(e0) + (local % kQuads) * 4;
        v[u][0] = v[u][1] = v[u][2] = v[u][3] = 0.f;
        if (idx < 2 * count && r < p.rows && e < p.elements) {
          const float* row = (which ? p.y : p.x) + base + static_cast<size_t>(r) * stride;
          if (e < p.packed_matrix) {  // four bf16 (their lo parts are zero)
            const uint2 x = __ldg(
                reinterpret_cast<const uint2*>(reinterpret_cast<const __nv_bfloat16*>(row) + e));
            const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&x.x));
            const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&x.y));
            v[u][0] = a.x, v[u][1] = a.y, v[u][2] = b.x, v[u][3] = b.y;
          } else {
            const float4 x = __ldg(
                reinterpret_cast<const float4*>(row + p.packed_matrix / 2 + e - p.packed_matrix));
            v[u][0] = x.x, v[u][1] = x.y, v[u][2] = x.z, v[u][3] = x.w;
          }
        }
      }
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int idx = first + u * kThreads;
        if (idx >= 2 * count) break;
        const int which = idx >= count, local = idx - which * count;
        const int at = (local / kQuads) * kLd + (local % kQuads) * 4;
#pragma unroll
        for (int a = 0; a < kParts; ++a) {
          float rounded[4];
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            rounded[i] = __bfloat162float(__float2bfloat16_rn(v[u][i]));
            v[u][i] -= rounded[i];  // exact in fp32: what the next part carries
          }
          store_pack<__nv_bfloat16, 4>(part(which, a) + at, rounded);
        }
      }
    }
    __syncthreads();
#pragma unroll
    for (int u = 0; u < kUnits; ++u) {
      const int unit = warp + u * kWarps;
      if (unit >= units) break;
      const int fm = unit / side, fn = unit % side;
#pragma unroll
      for (int a = 0; a < kParts; ++a) {
#pragma unroll
        for (int b = 0; a + b < kParts; ++b) {
          wmma_tiles::mma_tile<__nv_bfloat16, false, true>(acc[u], part(0, a), kLd, part(1, b), kLd,
                                                           fm, fn, kColumns);
        }
      }
    }
  }
  // Each tile of G has one owner warp: through shared memory, then one atomic add per entry (or,
  // for ordered sums, the CTA's part written whole).
  __syncthreads();
  float* g = reinterpret_cast<float*>(smem);  // [padded][padded]
#pragma unroll
  for (int u = 0; u < kUnits; ++u) {
    const int unit = warp + u * kWarps;
    if (unit >= units) break;
    acc[u].store(g + (unit / side) * 16 * padded + (unit % side) * 16, padded);
  }
  __syncthreads();
  float* const cta_part = p.grad_parts != nullptr
                              ? p.grad_parts + static_cast<size_t>(blockIdx.x) * p.rows * p.rows
                              : nullptr;
  for (int entry = t; entry < padded * padded; entry += kThreads) {
    const int i = entry / padded, j = entry % padded;
    if (i >= p.rows || j >= p.rows) continue;
    if (cta_part != nullptr) {
      cta_part[i * p.rows + j] = g[entry];
    } else {
      atomicAdd(p.grad + i * p.rows + j, g[entry]);
    }
  }
}

// Up to 32 rows: the warps' products straight from registers, no shared memory and no barriers.
// The tiled kernel above spends most of its time waiting: each item's loads, then a barrier, the
// split into shared memory, a barrier and products on one warp of eight at 16 rows (156 us for the
// 270 MB of MHLA's trained pairs at T = 2,048, B * H = 128: 1.7 TB/s).
//
// Each warp takes its own (batch*head, chunk of kFragmentChunk elements) items. Per 16 elements a
// lane loads four consecutive elements of each of its rows (lane / 4 + 8 g) of X and of Y; elements
// 0-1 fill the k-slots 2 (lane % 4) and the next of mma.sync m16n8k16's fragments, elements 2-3 the
// slots 8 higher. X and Y use the same slot-to-element map, so each product pairs X_ik with Y_jk.
// The row-major A fragment (rows lane / 4 and + 8) and the column-major B fragment (columns
// lane / 4) take the same registers of a lane's rows: X's for A, Y's for B.
constexpr int kFragmentChunk = 512;

template <int RowTiles>  // 16-row tiles of G's side: 1 (rows <= 16) or 2 (rows <= 32)
__global__ void __launch_bounds__(kThreads, 2) fragment_pair_products_kernel(BlockPairProducts p) {
  constexpr int kRowGroups = 2 * RowTiles;       // this lane's rows: lane / 4 + 8 g
  constexpr int kSteps = RowTiles == 1 ? 4 : 1;  // 16-element steps whose loads go out together
  constexpr int kSide = 16 * RowTiles;
  __shared__ float g[kSide * kSide];
  const int t = threadIdx.x, lane = t % 32;
  for (int i = t; i < kSide * kSide; i += kThreads) g[i] = 0.f;
  float acc[RowTiles][kRowGroups][4] = {};                  // (16-row tile of X, 8-row group of Y)
  const int64_t stride = p.elements - p.packed_matrix / 2;  // floats per block
  const int64_t chunks = (p.elements + kFragmentChunk - 1) / kFragmentChunk;
  const int64_t items = static_cast<int64_t>(p.batch_heads) * chunks;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (kThreads / 32);
  // Four elements from e of one block row as fp32 (zeros past the rows or the elements).
  auto load4 = [&](const float* set, int64_t bh, int r, int64_t e) {
    float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
    if (r >= p.rows || e >= p.elements) return v;
    const float* row = set + (static_cast<size_t>(bh) * p.blocks + r) * stride;
    if (e < p.packed_matrix) {  // four bf16
      const uint2 x =
          __ldg(reinterpret_cast<const uint2*>(reinterpret_cast<const __nv_bfloat16*>(row) + e));
      const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&x.x));
      const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&x.y));
      return make_float4(a.x, a.y, b.x, b.y);
    }
    return __ldg(reinterpret_cast<const float4*>(row + p.packed_matrix / 2 + e - p.packed_matrix));
  };
  // The high and low bf16 parts of (a, b), packed as one fragment register each.
  auto split = [](float a, float b, unsigned* hi, unsigned* lo) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    const float2 back = __bfloat1622float2(h);
    const __nv_bfloat162 l = __floats2bfloat162_rn(a - back.x, b - back.y);
    *hi = *reinterpret_cast<const unsigned*>(&h);
    *lo = *reinterpret_cast<const unsigned*>(&l);
  };
  for (int64_t item = blockIdx.x * (kThreads / 32) + t / 32; item < items; item += warps) {
    const int64_t bh = item / chunks, begin = (item % chunks) * kFragmentChunk;
    const int64_t end = begin + kFragmentChunk < p.elements ? begin + kFragmentChunk : p.elements;
    for (int64_t e0 = begin; e0 < end; e0 += 16 * kSteps) {
      float4 x[kSteps][kRowGroups], y[kSteps][kRowGroups];
#pragma unroll
      for (int s = 0; s < kSteps; ++s) {
        const int64_t e = e0 + 16 * s + (lane % 4) * 4;
#pragma unroll
        for (int r = 0; r < kRowGroups; ++r) {
          x[s][r] = e < end ? load4(p.x, bh, lane / 4 + 8 * r, e) : make_float4(0.f, 0.f, 0.f, 0.f);
          y[s][r] = e < end ? load4(p.y, bh, lane / 4 + 8 * r, e) : make_float4(0.f, 0.f, 0.f, 0.f);
        }
      }
#pragma unroll
      for (int s = 0; s < kSteps; ++s) {
        // [r][0]: elements 0-1 (k-slots 2 (lane % 4) + 0, 1), [r][1]: elements 2-3 (slots + 8).
        unsigned xh[kRowGroups][2], xl[kRowGroups][2], yh[kRowGroups][2], yl[kRowGroups][2];
#pragma unroll
        for (int r = 0; r < kRowGroups; ++r) {
          split(x[s][r].x, x[s][r].y, &xh[r][0], &xl[r][0]);
          split(x[s][r].z, x[s][r].w, &xh[r][1], &xl[r][1]);
          split(y[s][r].x, y[s][r].y, &yh[r][0], &yl[r][0]);
          split(y[s][r].z, y[s][r].w, &yh[r][1], &yl[r][1]);
        }
#pragma unroll
        for (int m = 0; m < RowTiles; ++m) {
          // A: rows 16 m + lane / 4 (group 2 m) and + 8 (group 2 m + 1).
          const unsigned ah[4] = {xh[2 * m][0], xh[2 * m + 1][0], xh[2 * m][1], xh[2 * m + 1][1]};
          const unsigned al[4] = {xl[2 * m][0], xl[2 * m + 1][0], xl[2 * m][1], xl[2 * m + 1][1]};
#pragma unroll
          for (int n = 0; n < kRowGroups; ++n) {
            wmma_tiles::detail::mma16816<__nv_bfloat16>(acc[m][n], ah, yh[n][0], yh[n][1]);
            wmma_tiles::detail::mma16816<__nv_bfloat16>(acc[m][n], ah, yl[n][0], yl[n][1]);
            wmma_tiles::detail::mma16816<__nv_bfloat16>(acc[m][n], al, yh[n][0], yh[n][1]);
          }
        }
      }
    }
  }
  // acc[m][n]: G rows 16 m + lane / 4 (+ 8 for [2], [3]), columns 8 n + 2 (lane % 4) (+ 1).
  if (p.grad_parts != nullptr) {
    // Ordered sums: each warp writes its own part whole (its lanes hold every entry once).
    float* const part =
        p.grad_parts +
        (static_cast<size_t>(blockIdx.x) * (kThreads / 32) + t / 32) * p.rows * p.rows;
#pragma unroll
    for (int m = 0; m < RowTiles; ++m)
#pragma unroll
      for (int n = 0; n < kRowGroups; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int row = 16 * m + lane / 4 + (i / 2) * 8, col = 8 * n + (lane % 4) * 2 + i % 2;
          if (row < p.rows && col < p.rows) part[row * p.rows + col] = acc[m][n][i];
        }
    return;
  }
  __syncthreads();  // g is zeroed
#pragma unroll
  for (int m = 0; m < RowTiles; ++m) {
#pragma unroll
    for (int n = 0; n < kRowGroups; ++n) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int row = 16 * m + lane / 4 + (i / 2) * 8, col = 8 * n + (lane % 4) * 2 + i % 2;
        atomicAdd(&g[row * kSide + col], acc[m][n][i]);
      }
    }
  }
  __syncthreads();
  for (int entry = t; entry < kSide * kSide; entry += kThreads) {
    const int i = entry / kSide, j = entry % kSide;
    if (i < p.rows && j < p.rows) atomicAdd(p.grad + i * p.rows + j, g[entry]);
  }
}

template <int RowTiles>
int fragment_ctas(const BlockPairProducts& p) {
  const int64_t chunks = (p.elements + kFragmentChunk - 1) / kFragmentChunk;
  const int64_t warp_items = static_cast<int64_t>(p.batch_heads) * chunks;
  const int64_t wanted = (warp_items + kWarps - 1) / kWarps;
  // Resident CTAs per SM: a property of the kernel, asked once (this runs in every backward).
  static const int per_sm = [] {
    int count = 0;
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&count, fragment_pair_products_kernel<RowTiles>,
                                                  kThreads, 0);
    return std::max(1, count);
  }();
  const int resident = per_sm * multiprocessors();
  return static_cast<int>(std::min<int64_t>(wanted, resident));
}

template <int RowTiles>
cudaError_t launch_fragment_products(const BlockPairProducts& p, cudaStream_t stream) {
  fragment_pair_products_kernel<RowTiles><<<fragment_ctas<RowTiles>(p), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

// The tiled kernel's grid: several CTAs per SM so that one's loads overlap another's products.
int tiled_ctas(const BlockPairProducts& p) {
  const size_t bytes = shared_bytes(p.rows);
  const int64_t items =
      static_cast<int64_t>(p.batch_heads) * ((p.elements + kColumns - 1) / kColumns);
  const int per_sm = std::max<int>(1, std::min<int>(8, static_cast<int>((200 * 1024) / bytes)));
  return static_cast<int>(std::min<int64_t>(items, int64_t{per_sm} * multiprocessors()));
}

bool valid(const BlockPairProducts& p) {
  return p.x != nullptr && p.y != nullptr && p.batch_heads > 0 && p.rows >= 1 &&
         p.rows <= kMaxRows && p.rows <= p.blocks && p.elements > 0 && p.elements % 4 == 0 &&
         p.packed_matrix >= 0 && p.packed_matrix % 8 == 0 && p.packed_matrix <= p.elements;
}

// MHLA_PAIR_PRODUCTS_SHARED=1 keeps the tiled shared-memory kernel at every size (A/B runs); read
// on every call.
bool shared_products_forced() {
  const char* value = std::getenv("MHLA_PAIR_PRODUCTS_SHARED");
  return value != nullptr && value[0] == '1';
}

}  // namespace

int64_t block_pair_products_parts(const BlockPairProducts& p) {
  if (!valid(p)) return -1;
  if (!shared_products_forced() && p.rows <= 16) return int64_t{fragment_ctas<1>(p)} * kWarps;
  if (!shared_products_forced() && p.rows <= 32) return int64_t{fragment_ctas<2>(p)} * kWarps;
  return tiled_ctas(p);
}

cudaError_t block_pair_products(const BlockPairProducts& p, cudaStream_t stream) {
  if (!valid(p) || (p.grad == nullptr && p.grad_parts == nullptr)) return cudaErrorInvalidValue;
  if (!shared_products_forced() && p.rows <= 16) return launch_fragment_products<1>(p, stream);
  if (!shared_products_forced() && p.rows <= 32) return launch_fragment_products<2>(p, stream);
  const size_t bytes = shared_bytes(p.rows);
  if (bytes > 48 * 1024) {
    const cudaError_t err = cudaFuncSetAttribute(
        pair_products_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
    if (err != cudaSuccess) return err;
  }
  pair_products_kernel<<<tiled_ctas(p), kThreads, bytes, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace mhla_kernels
