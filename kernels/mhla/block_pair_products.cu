// G_ij += sum X_i * Y_j over batch*head and state elements (see block_pair_products.h), on tensor
// cores: each item's rows go to shared memory as two bf16 parts (x = hi + lo, lo the bf16 rounding
// of x - hi), and G += Xh Yh^T + Xh Yl^T + Xl Yh^T by mma.sync with fp32 accumulation: about 2^-17
// relative per term (the dropped Xl Yl^T and lo's own rounding). The SIMT kernel this replaces
// was bound by its shared-memory reads (one per two FMAs).
#include <algorithm>

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
  // Each tile of G has one owner warp: through shared memory, then one atomic add per entry.
  __syncthreads();
  float* g = reinterpret_cast<float*>(smem);  // [padded][padded]
#pragma unroll
  for (int u = 0; u < kUnits; ++u) {
    const int unit = warp + u * kWarps;
    if (unit >= units) break;
    acc[u].store(g + (unit / side) * 16 * padded + (unit % side) * 16, padded);
  }
  __syncthreads();
  for (int entry = t; entry < padded * padded; entry += kThreads) {
    const int i = entry / padded, j = entry % padded;
    if (i < p.rows && j < p.rows) atomicAdd(p.grad + i * p.rows + j, g[entry]);
  }
}

}  // namespace

cudaError_t block_pair_products(const BlockPairProducts& p, cudaStream_t stream) {
  if (p.x == nullptr || p.y == nullptr || p.grad == nullptr || p.batch_heads <= 0 || p.rows < 1 ||
      p.rows > kMaxRows || p.rows > p.blocks || p.elements <= 0 || p.elements % 4 != 0 ||
      p.packed_matrix < 0 || p.packed_matrix % 8 != 0 || p.packed_matrix > p.elements)
    return cudaErrorInvalidValue;
  const size_t bytes = shared_bytes(p.rows);
  if (bytes > 48 * 1024) {
    const cudaError_t err = cudaFuncSetAttribute(
        pair_products_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
    if (err != cudaSuccess) return err;
  }
  const int64_t items =
      static_cast<int64_t>(p.batch_heads) * ((p.elements + kColumns - 1) / kColumns);
  // Several CTAs per SM so that one's loads overlap another's products.
  const int per_sm = std::max<int>(1, std::min<int>(8, static_cast<int>((200 * 1024) / bytes)));
  const int ctas = static_cast<int>(std::min<int64_t>(items, int64_t{per_sm} * multiprocessors()));
  pair_products_kernel<<<ctas, kThreads, bytes, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace mhla_kernels
