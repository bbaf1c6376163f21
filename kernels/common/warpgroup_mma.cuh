#pragma once
// Hopper warpgroup products (wgmma, sm_90a) on 16-bit shared-memory tiles, and the warp-level
// mma.sync products that continue on the same accumulators.
//
// Tiles are stored as 8 x 8 core matrices (128 contiguous bytes each, rows of 16 bytes), row
// groups major: element (r, c) of a [rows][Cols] tile sits at ((r / 8) (Cols / 8) + c / 8) 64 +
// (r % 8) 8 + c % 8. wgmma reads a K-major operand in that layout without swizzling (core
// matrices 128 bytes apart along K, Cols * 16 bytes apart along M or N), and ldmatrix reads any
// 8 x 8 block of it, plain or transposed, so one copy of a tile serves both kinds of product.
// A warpgroup's 64 x N fp32 accumulator is float[N / 2] per thread in mma.sync's layout: warp w
// of the group holds rows 16 w + lane / 4 (+ 8), and n8-tile j is elements 4 j .. 4 j + 3.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "common/element_type.cuh"
#include "common/wmma_gemm.cuh"

namespace mhla_kernels {
namespace warpgroup {

// A [rows][Cols] 16-bit tile in core-matrix layout: row groups major (Rows = 0), or with
// Rows > 0 column blocks major (element (r, c) at ((c / 8) Rows + r) 8 + c % 8: the order in
// which the tensor copy engine writes a box of 8-column blocks; see tensor_copy.cuh).
template <typename T, int Cols, int Rows = 0>
struct CoreTile {
  static_assert(Cols % 16 == 0, "whole k16 steps");
  using elem = T;
  T* p;
  __device__ T* at(int r, int c) const {
    if constexpr (Rows > 0) {
      return p + ((c >> 3) * Rows + r) * 8 + (c & 7);
    } else {
      return p + ((r >> 3) * (Cols / 8) + (c >> 3)) * 64 + (r & 7) * 8 + (c & 7);
    }
  }
  // Bytes between core matrices adjacent along the columns (K) and along the rows (M or N).
  static constexpr uint32_t k_stride = Rows > 0 ? 16 * Rows : 128;
  static constexpr uint32_t mn_stride = Rows > 0 ? 128 : 16 * Cols;
  // Descriptors of an operand starting at `start` (an element at(r, c)): read with the columns
  // as the depth (K-major), or with the rows as the depth (M- or N-major, transposed).
  __device__ static uint64_t k_major(const void* start);
  __device__ static uint64_t mn_major(const void* start);
};

// A [Rows][64] 16-bit tile with 128-byte rows in the 128-byte swizzle that the tensor copy
// engine writes for a box 64 elements wide: the 16-byte piece c / 8 of row r sits at piece
// (c / 8) ^ (r % 8) of its row. Whole-row boxes reach the copy engine as 128-byte requests (the
// core-matrix layout above needs 16-byte ones, eight per row). The base must be 1024-byte aligned
// (the swizzle follows the address bits); a product's operand starts at a row that is a multiple
// of 8 (and, read transposed, at column 0).
template <typename T, int Rows>
struct SwizzledTile {
  static_assert(Rows % 8 == 0, "whole 8-row swizzle atoms");
  using elem = T;
  T* p;
  __device__ T* at(int r, int c) const {
    return p + r * 64 + ((((c >> 3) ^ r) & 7) << 3) + (c & 7);
  }
  __device__ static uint64_t k_major(const void* start);
  __device__ static uint64_t mn_major(const void* start);
};

// Shared-memory matrix descriptor: start address, leading and stride byte offsets, and the
// swizzle mode (0: none, 1: 128-byte).
__device__ __forceinline__ uint64_t descriptor(const void* start, uint32_t leading_bytes,
                                               uint32_t stride_bytes, uint64_t swizzle = 0) {
  const uint32_t address = static_cast<uint32_t>(__cvta_generic_to_shared(start));
  return static_cast<uint64_t>((address & 0x3FFFF) >> 4) |
         (static_cast<uint64_t>(leading_bytes >> 4) << 16) |
         (static_cast<uint64_t>(stride_bytes >> 4) << 32) | (swizzle << 62);
}

// Unswizzled core matrices: K-major steps along K by the leading offset and along M or N by the
// stride offset; transposed, the two trade places.
template <typename T, int Cols, int Rows>
__device__ __forceinline__ uint64_t CoreTile<T, Cols, Rows>::k_major(const void* start) {
  return descriptor(start, k_stride, mn_stride);
}
template <typename T, int Cols, int Rows>
__device__ __forceinline__ uint64_t CoreTile<T, Cols, Rows>::mn_major(const void* start) {
  return descriptor(start, mn_stride, k_stride);
}

// 128-byte swizzle: K-major, a k16 step lies inside one 128-byte row (no leading offset) and
// 8-row groups are 1024 bytes apart; transposed, the 64 columns are one swizzle atom wide (no
// leading offset) and the depth's 8-row groups are again 1024 bytes apart.
template <typename T, int Rows>
__device__ __forceinline__ uint64_t SwizzledTile<T, Rows>::k_major(const void* start) {
  return descriptor(start, 16, 1024, 1);
}
template <typename T, int Rows>
__device__ __forceinline__ uint64_t SwizzledTile<T, Rows>::mn_major(const void* start) {
  return descriptor(start, 16, 1024, 1);
}

template <typename T, int N>
struct WarpgroupMma;
template <typename T, int N>
struct WarpgroupMmaRegisterA;
#include "common/warpgroup_mma_ops.inc"

// Orders this thread's earlier generic-proxy shared-memory writes (plain stores, cp.async)
// before later reads by the tensor cores' async proxy; a barrier must follow.
__device__ __forceinline__ void fence_shared_for_mma() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
__device__ __forceinline__ void fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int Pending>
__device__ __forceinline__ void wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(Pending) : "memory");
}
// Keeps the compiler from moving accumulator reads or writes across the asynchronous products.
template <int R>
__device__ __forceinline__ void pin(float (&acc)[R]) {
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+f"(acc[i])::"memory");
}

// Issues acc (+)= A B^T over depth K for A = rows a_row0 .. a_row0 + 63 of a (K-major, [.][KA]
// columns from a_col0) and B^T = rows b_row0 .. b_row0 + N - 1 of b (K-major, from b_col0):
// K / 16 wgmmas, one commit group. The caller fences before (fence()) and waits after.
template <typename T, int N, int K, typename TileA, typename TileB>
__device__ __forceinline__ void product(float (&acc)[N / 2], TileA a, int a_row0, int a_col0,
                                        TileB b, int b_row0, int b_col0, bool accumulate) {
  pin(acc);
#pragma unroll
  for (int kk = 0; kk < K; kk += 16) {
    const uint64_t da = TileA::k_major(a.at(a_row0, a_col0 + kk));
    const uint64_t db = TileB::k_major(b.at(b_row0, b_col0 + kk));
    WarpgroupMma<T, N>::run(acc, da, db, (accumulate || kk > 0) ? 1 : 0);
  }
  commit();
  pin(acc);
}

// Issues acc (+)= A B over depth K for A given as register fragments (to_a_fragments of a
// 64 x K accumulator: k-block kb is a[kb]) and B = rows b_row0 .. b_row0 + K - 1 (the depth) and
// columns b_col0 .. b_col0 + N - 1 of tile b, read N-major (transposed: no copy of b with the
// depth along its columns is needed). One commit group; the caller fences before and waits
// after, and keeps the fragments unchanged until then.
template <typename T, int N, int K, typename TileB>
__device__ __forceinline__ void product_register_a(float (&acc)[N / 2],
                                                   const unsigned (&a)[K / 16][4], TileB b,
                                                   int b_row0, int b_col0, bool accumulate) {
  pin(acc);
#pragma unroll
  for (int kb = 0; kb < K / 16; ++kb) {
    const uint64_t db = TileB::mn_major(b.at(b_row0 + 16 * kb, b_col0));
    WarpgroupMmaRegisterA<T, N>::run(acc, a[kb], db, (accumulate || kb > 0) ? 1 : 0);
  }
  commit();
  pin(acc);
}

// ---- Warp-level products on a warp's 16-row strip of a warpgroup accumulator (mma.sync).

// Four 8 x 8 blocks at the lanes' row addresses (ldmatrix .x4, transposed when Transpose).
template <bool Transpose>
__device__ __forceinline__ void load_blocks(unsigned (&r)[4], const void* row) {
  wmma_tiles::detail::load_matrices<Transpose>(r, row);
}

// acc[n8 tiles n_begin / 8 ..] += A B for the strip's 16 rows: A [16][k] is rows a_row0.. of a
// (stored [k][m], columns a_row0.., when TransA), B [k][n] is b from column n0 (stored [n][k]
// when TransB), depth k over [k_begin, k_end) in steps of 16; Cols16 blocks of 16 columns.
template <typename T, bool TransA, bool TransB, int Cols16, int R, typename TileA, typename TileB>
__device__ __forceinline__ void strip_product(float (&acc)[R], int acc_n0, TileA a, int a_row0,
                                              TileB b, int n0, int k_begin, int k_end) {
  const int lane = threadIdx.x % 32, quad = lane / 8, row8 = lane % 8;
  for (int kk = k_begin; kk < k_end; kk += 16) {
    unsigned fa[4];
    if constexpr (TransA) {
      load_blocks<true>(fa, a.at(kk + (quad / 2) * 8 + row8, a_row0 + (quad % 2) * 8));
    } else {
      load_blocks<false>(fa, a.at(a_row0 + (quad % 2) * 8 + row8, kk + (quad / 2) * 8));
    }
#pragma unroll
    for (int j = 0; j < Cols16; ++j) {
      const int c0 = n0 + 16 * j;
      unsigned fb[4];
      if constexpr (TransB) {
        load_blocks<false>(fb, b.at(c0 + (quad / 2) * 8 + row8, kk + (quad % 2) * 8));
      } else {
        load_blocks<true>(fb, b.at(kk + (quad % 2) * 8 + row8, c0 + (quad / 2) * 8));
      }
      float(&d0)[4] = *reinterpret_cast<float(*)[4]>(&acc[(acc_n0 / 8 + 2 * j) * 4]);
      float(&d1)[4] = *reinterpret_cast<float(*)[4]>(&acc[(acc_n0 / 8 + 2 * j + 1) * 4]);
      wmma_tiles::detail::mma16816<T>(d0, fa, fb[0], fb[1]);
      wmma_tiles::detail::mma16816<T>(d1, fa, fb[2], fb[3]);
    }
  }
}

// The 16-bit A fragments of a warp's 16 x K strip held as an accumulator (K / 2 floats, n8-tile
// layout): k-block kb is accumulator tiles 2 kb and 2 kb + 1 (mma.sync's accumulator and A
// layouts agree row for row).
template <typename T, int R>
__device__ __forceinline__ void to_a_fragments(const float (&acc)[R], unsigned (&frag)[R / 8][4]);

// acc[n8 tiles from acc_n0 / 8] += A B for the strip's 16 rows with A given as fragments
// (to_a_fragments) over depth k in [k_begin, k_end) and B [k][n] from column n0 of b (stored
// [n][k] when TransB).
template <typename T, bool TransB, int Cols16, int R, int KBlocks, typename TileB>
__device__ __forceinline__ void strip_product_from_registers(float (&acc)[R], int acc_n0,
                                                             const unsigned (&frag)[KBlocks][4],
                                                             TileB b, int n0, int k_begin,
                                                             int k_end) {
  const int lane = threadIdx.x % 32, quad = lane / 8, row8 = lane % 8;
#pragma unroll
  for (int kb = 0; kb < KBlocks; ++kb) {
    const int kk = 16 * kb;
    if (kk < k_begin || kk >= k_end) continue;
#pragma unroll
    for (int j = 0; j < Cols16; ++j) {
      const int c0 = n0 + 16 * j;
      unsigned fb[4];
      if constexpr (TransB) {
        load_blocks<false>(fb, b.at(c0 + (quad / 2) * 8 + row8, kk + (quad % 2) * 8));
      } else {
        load_blocks<true>(fb, b.at(kk + (quad % 2) * 8 + row8, c0 + (quad / 2) * 8));
      }
      float(&d0)[4] = *reinterpret_cast<float(*)[4]>(&acc[(acc_n0 / 8 + 2 * j) * 4]);
      float(&d1)[4] = *reinterpret_cast<float(*)[4]>(&acc[(acc_n0 / 8 + 2 * j + 1) * 4]);
      wmma_tiles::detail::mma16816<T>(d0, frag[kb], fb[0], fb[1]);
      wmma_tiles::detail::mma16816<T>(d1, frag[kb], fb[2], fb[3]);
    }
  }
}

// Where element i of a thread's accumulator lies in the 64 x N tile of its warpgroup.
__device__ __forceinline__ int acc_row(int i) {
  return 16 * ((threadIdx.x / 32) % 4) + (threadIdx.x % 32) / 4 + ((i % 4) >= 2 ? 8 : 0);
}
__device__ __forceinline__ int acc_col(int i) {
  return 8 * (i / 4) + 2 * (threadIdx.x % 4) + (i % 2);
}

// The 16-bit pair (x, y) as one register (x in the low half): common/element_type.cuh.
using ::mhla_kernels::pack_pair;

template <typename T, int R>
__device__ __forceinline__ void to_a_fragments(const float (&acc)[R], unsigned (&frag)[R / 8][4]) {
#pragma unroll
  for (int kb = 0; kb < R / 8; ++kb) {
    frag[kb][0] = pack_pair<T>(acc[8 * kb], acc[8 * kb + 1]);
    frag[kb][1] = pack_pair<T>(acc[8 * kb + 2], acc[8 * kb + 3]);
    frag[kb][2] = pack_pair<T>(acc[8 * kb + 4], acc[8 * kb + 5]);
    frag[kb][3] = pack_pair<T>(acc[8 * kb + 6], acc[8 * kb + 7]);
  }
}

// The accumulator as 16-bit values into a core tile at (row0 + its rows, col0 + its columns).
template <typename Tile, int R>
__device__ __forceinline__ void store_accumulator(Tile t, int row0, int col0, const float (&acc)[R],
                                                  float scale = 1.f) {
#pragma unroll
  for (int i = 0; i < R; i += 2) {
    *reinterpret_cast<unsigned*>(t.at(row0 + acc_row(i), col0 + acc_col(i))) =
        pack_pair<typename Tile::elem>(scale * acc[i], scale * acc[i + 1]);
  }
}

// Rows of a [rows][Cols] token-major global matrix (row stride `stride` elements) into a core
// tile, asynchronously (cp.async, 16 bytes per copy; rows >= valid zero). Consecutive threads
// fill consecutive 16-byte rows of the core matrices: no bank conflicts, and a warp reads 64
// contiguous bytes of each of 8 rows.
template <typename T, int Rows, int Cols, int Threads>
__device__ __forceinline__ void copy_rows_async(CoreTile<T, Cols> dst, const T* src, int stride,
                                                int valid) {
  constexpr int kCopies = Rows * Cols / 8;
#pragma unroll
  for (int j = 0; j < (kCopies + Threads - 1) / Threads; ++j) {
    const int e = static_cast<int>(threadIdx.x) + j * Threads;
    if (kCopies % Threads == 0 || e < kCopies) {
      const int core = e / 8, r = (core / (Cols / 8)) * 8 + e % 8, c = (core % (Cols / 8)) * 8;
      const bool in = r < valid;
      const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(dst.p + 8 * e));
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s),
                   "l"(src + (in ? r * stride : 0) + c), "r"(in ? 16 : 0));
    }
  }
}

}  // namespace warpgroup
}  // namespace mhla_kernels
