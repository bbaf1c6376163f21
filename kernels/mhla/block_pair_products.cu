// G_ij += sum X_i * Y_j over batch*head and state elements (see block_pair_products.h).
#include <algorithm>

#include "common/device_info.h"
#include "common/packed_access.cuh"
#include "mhla/block_pair_products.h"
#include "mhla/state_storage.cuh"

namespace mhla_kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kColumns = 128;      // state elements per item
constexpr int kLd = kColumns + 1;  // shared rows: conflict-free column reads
constexpr int kMaxRows = 64;
constexpr int kReduceFloats = kThreads * 16;  // every thread's 4 x 4 tile

__host__ __device__ constexpr int padded_rows(int rows) {
  return (rows + 3) / 4 * 4;
}

size_t shared_bytes(int rows) {
  const size_t tiles = 2 * static_cast<size_t>(padded_rows(rows)) * kLd;
  return std::max<size_t>(tiles, kReduceFloats) * sizeof(float);
}

template <typename S>
__global__ void __launch_bounds__(kThreads) pair_products_kernel(BlockPairProducts p) {
  extern __shared__ __align__(16) float smem[];
  const int padded = padded_rows(p.rows), side = padded / 4, tiles = side * side;
  const int groups = kThreads / tiles;  // column groups: threads that split an item's columns
  float* xs = smem;                     // [padded][kLd]
  float* ys = smem + padded * kLd;
  const int t = threadIdx.x, tile = t % tiles, group = t / tiles;
  const int ti = tile / side, tj = tile % side;
  const bool computes = group < groups;
  float acc[4][4] = {};
  const int64_t columns = (p.elements + kColumns - 1) / kColumns;
  const int64_t items = static_cast<int64_t>(p.batch_heads) * columns;
  constexpr int kQuads = kColumns / 4;  // float4 groups per row of an item
  for (int64_t item = blockIdx.x; item < items; item += gridDim.x) {
    const int64_t bh = item / columns, e0 = (item % columns) * kColumns;
    const size_t base = static_cast<size_t>(bh) * p.blocks * p.elements;
    __syncthreads();  // the previous item's reads are done
    // Up to 64 x 128 elements per set: every load of the item is issued before the first store.
    constexpr int kBatch = 8;
    const int count = padded * kQuads;  // groups of four elements per set
    for (int first = t; first < 2 * count; first += kBatch * kThreads) {
      float v[kBatch][4];
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int idx = first + u * kThreads;
        const int which = idx >= count, local = idx - which * count;
        const int r = local / kQuads, e = static_cast<int>(e0) + (local % kQuads) * 4;
        v[u][0] = v[u][1] = v[u][2] = v[u][3] = 0.f;
        if (idx < 2 * count && r < p.rows && e < p.elements) {
          const S* src = static_cast<const S*>(which ? p.y : p.x) + base +
                         static_cast<size_t>(r) * p.elements + e;
          load_pack<S, 4>(src, v[u]);
        }
      }
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int idx = first + u * kThreads;
        if (idx >= 2 * count) break;
        const int which = idx >= count, local = idx - which * count;
        float* dst = (which ? ys : xs) + (local / kQuads) * kLd + (local % kQuads) * 4;
        dst[0] = v[u][0], dst[1] = v[u][1], dst[2] = v[u][2], dst[3] = v[u][3];
      }
    }
    __syncthreads();
    if (computes) {
      for (int c = group; c < kColumns; c += groups) {
        float a[4], b[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          a[u] = xs[(4 * ti + u) * kLd + c];
          b[u] = ys[(4 * tj + u) * kLd + c];
        }
#pragma unroll
        for (int u = 0; u < 4; ++u)
#pragma unroll
          for (int w = 0; w < 4; ++w) acc[u][w] += a[u] * b[w];
      }
    }
  }
  // The column groups' tiles summed through shared memory, then one atomic add per entry of G.
  __syncthreads();
  float* partial = smem;  // [group][tile][16]
  if (computes) {
#pragma unroll
    for (int u = 0; u < 4; ++u)
#pragma unroll
      for (int w = 0; w < 4; ++w) partial[(group * tiles + tile) * 16 + u * 4 + w] = acc[u][w];
  }
  __syncthreads();
  for (int entry = t; entry < tiles * 16; entry += kThreads) {
    const int owner = entry / 16, k = entry % 16;
    const int i = 4 * (owner / side) + k / 4, j = 4 * (owner % side) + k % 4;
    if (i >= p.rows || j >= p.rows) continue;
    float sum = 0.f;
    for (int g = 0; g < groups; ++g) sum += partial[(g * tiles + owner) * 16 + k];
    atomicAdd(p.grad + i * p.rows + j, sum);
  }
}

}  // namespace

cudaError_t block_pair_products(const BlockPairProducts& p, cudaStream_t stream) {
  if (p.x == nullptr || p.y == nullptr || p.grad == nullptr || p.batch_heads <= 0 || p.rows < 1 ||
      p.rows > kMaxRows || p.rows > p.blocks || p.elements <= 0 || p.elements % 4 != 0)
    return cudaErrorInvalidValue;
  return with_state_type(p.type, [&](auto tag) {
    using S = decltype(tag);
    const size_t bytes = shared_bytes(p.rows);
    if (bytes > 48 * 1024) {
      const cudaError_t err =
          cudaFuncSetAttribute(pair_products_kernel<S>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               static_cast<int>(bytes));
      if (err != cudaSuccess) return err;
    }
    const int64_t items =
        static_cast<int64_t>(p.batch_heads) * ((p.elements + kColumns - 1) / kColumns);
    // Several CTAs per SM so that one's loads overlap another's products.
    const int per_sm = std::max<int>(1, std::min<int>(8, static_cast<int>((200 * 1024) / bytes)));
    const int ctas =
        static_cast<int>(std::min<int64_t>(items, int64_t{per_sm} * multiprocessors()));
    pair_products_kernel<S><<<ctas, kThreads, bytes, stream>>>(p);
    return cudaGetLastError();
  });
}

}  // namespace mhla_kernels
