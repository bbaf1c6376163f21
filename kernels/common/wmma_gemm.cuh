#pragma once
// Tensor-core tiles through WMMA, shared by every kernel family: the shared-memory element type
// and MMA precision per input type (bf16 and fp16 as themselves, fp32 as tf32), fragment types,
// and a whole-CTA product of shared-memory matrices with fp32 results.
#include <mma.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

namespace mhla_kernels {
namespace wmma_tiles {

using namespace nvcuda;

// Shared-memory element type and tensor-core precision for an input type.
template <typename T>
struct Mma;
template <>
struct Mma<__nv_bfloat16> {
  using elem = __nv_bfloat16;
  using precision = __nv_bfloat16;
  static constexpr int k = 16;
};
template <>
struct Mma<__half> {
  using elem = __half;
  using precision = __half;
  static constexpr int k = 16;
};
template <>
struct Mma<float> {
  using elem = float;
  using precision = wmma::precision::tf32;
  static constexpr int k = 8;
};

template <typename T, typename Layout>
using FragA = wmma::fragment<wmma::matrix_a, 16, 16, Mma<T>::k, typename Mma<T>::precision, Layout>;
template <typename T, typename Layout>
using FragB = wmma::fragment<wmma::matrix_b, 16, 16, Mma<T>::k, typename Mma<T>::precision, Layout>;
template <typename T>
using FragC = wmma::fragment<wmma::accumulator, 16, 16, Mma<T>::k, float>;

template <typename T, typename Frag>
__device__ __forceinline__ void load_fragment(Frag& f, const typename Mma<T>::elem* p,
                                              unsigned ld) {
  wmma::load_matrix_sync(f, p, ld);
  if constexpr (std::is_same_v<T, float>) {
    for (int i = 0; i < f.num_elements; ++i) f.x[i] = wmma::__float_to_tf32(f.x[i]);
  }
}

namespace detail {

__device__ __forceinline__ unsigned shared_address(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// Four 8 x 8 matrices of 16-bit elements from shared memory (row addresses from lanes 0-31),
// optionally transposed.
template <bool Transpose>
__device__ __forceinline__ void load_matrices(unsigned (&r)[4], const void* row) {
  if constexpr (Transpose) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(shared_address(row)));
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(shared_address(row)));
  }
}

// d += a b for one m16n8k16 tile (fp32 accumulators).
template <typename T>
__device__ __forceinline__ void mma16816(float (&d)[4], const unsigned (&a)[4], unsigned b0,
                                         unsigned b1) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

}  // namespace detail

// One 16 x 16 fp32 output tile of a 16-bit product in mma.sync's accumulator layout (two n8
// halves): this lane holds rows lane / 4 and lane / 4 + 8, columns 2 (lane % 4) and the next, of
// each half. Kept in registers across products (the gated-delta state passes carry their state
// in them from chunk to chunk).
struct TileAccumulator {
  float x[2][4];
  __device__ static int row(int i) { return static_cast<int>(threadIdx.x % 32) / 4 + (i / 2) * 8; }
  __device__ static int col(int h, int i) {
    return (static_cast<int>(threadIdx.x % 32) % 4) * 2 + h * 8 + i % 2;
  }
  __device__ void zero() {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int i = 0; i < 4; ++i) x[h][i] = 0.f;
    }
  }
  __device__ void scale(float s) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int i = 0; i < 4; ++i) x[h][i] *= s;
    }
  }
  // From / to a fp32 tile whose top-left element is at c (row stride ldc).
  // Column pairs (i, i + 1) are adjacent: one 8-byte access each (ldc even, c 8-byte aligned).
  __device__ void load(const float* c, int ldc) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int i = 0; i < 4; i += 2) {
        const float2 v = *reinterpret_cast<const float2*>(c + row(i) * ldc + col(h, i));
        x[h][i] = v.x, x[h][i + 1] = v.y;
      }
    }
  }
  __device__ void store(float* c, int ldc) const {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int i = 0; i < 4; i += 2) {
        *reinterpret_cast<float2*>(c + row(i) * ldc + col(h, i)) =
            make_float2(x[h][i], x[h][i + 1]);
      }
    }
  }
  // To a bf16 tile (a packed state set's matrix: the readers only ever take it as bf16 tiles).
  __device__ void store(__nv_bfloat16* c, int ldc) const {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int i = 0; i < 4; i += 2) {
        *reinterpret_cast<__nv_bfloat162*>(c + row(i) * ldc + col(h, i)) =
            __floats2bfloat162_rn(x[h][i], x[h][i + 1]);
      }
    }
  }
};

// acc[i][j] += A B over depth k for the Rows x Cols block of 16 x 16 output tiles whose first is
// at (row tile fm, column tile fn); same operand conventions as mma_tile below. Each A fragment
// serves Cols tiles and each B fragment Rows tiles: a 2 x 2 block reads shared memory once per
// two tensor-core products instead of once per product (the gated-delta and causal passes were
// bound by shared-memory throughput, not by the tensor cores).
template <typename T, bool TransA, bool TransB, int Rows, int Cols>
__device__ __forceinline__ void mma_block(TileAccumulator (&acc)[Rows][Cols], const T* a, int lda,
                                          const T* b, int ldb, int fm, int fn, int k) {
  const int lane = threadIdx.x % 32, quad = lane / 8, row8 = lane % 8;
  const T* a_row[Rows];
  const T* b_row[Cols];
#pragma unroll
  for (int i = 0; i < Rows; ++i) {
    const int m0 = (fm + i) * 16;
    a_row[i] = TransA ? a + ((quad / 2) * 8 + row8) * lda + m0 + (quad % 2) * 8
                      : a + (m0 + (quad % 2) * 8 + row8) * lda + (quad / 2) * 8;
  }
#pragma unroll
  for (int j = 0; j < Cols; ++j) {
    const int n0 = (fn + j) * 16;
    b_row[j] = TransB ? b + (n0 + (quad / 2) * 8 + row8) * ldb + (quad % 2) * 8
                      : b + ((quad % 2) * 8 + row8) * ldb + n0 + (quad / 2) * 8;
  }
  for (int kk = 0; kk < k; kk += 16) {
    unsigned fa[Rows][4], fb[Cols][4];
#pragma unroll
    for (int i = 0; i < Rows; ++i) {
      detail::load_matrices<TransA>(fa[i], TransA ? a_row[i] + kk * lda : a_row[i] + kk);
    }
#pragma unroll
    for (int j = 0; j < Cols; ++j) {
      detail::load_matrices<!TransB>(fb[j], TransB ? b_row[j] + kk : b_row[j] + kk * ldb);
    }
#pragma unroll
    for (int i = 0; i < Rows; ++i) {
#pragma unroll
      for (int j = 0; j < Cols; ++j) {
        detail::mma16816<T>(acc[i][j].x[0], fa[i], fb[j][0], fb[j][1]);
        detail::mma16816<T>(acc[i][j].x[1], fa[i], fb[j][2], fb[j][3]);
      }
    }
  }
}

// acc += A B over depth k for the 16 x 16 output tile at (row tile fm, column tile fn), with A
// [m][k] (lda; stored [k][m] when TransA) and B [k][n] (ldb; stored [n][k] when TransB) in shared
// memory: ldmatrix (transposing where stored transposed) + mma.sync m16n8k16, 16-bit T.
template <typename T, bool TransA, bool TransB>
__device__ void mma_tile(TileAccumulator& acc, const T* a, int lda, const T* b, int ldb, int fm,
                         int fn, int k) {
  const int lane = threadIdx.x % 32, quad = lane / 8, row8 = lane % 8;
  // Row addresses of the four 8 x 8 matrices each ldmatrix reads (PTX's m16n8k16 fragment
  // layouts: A as (rows 0-7, 8-15) x (k 0-7, 8-15), B as its two n8 halves).
  const T* a_row = TransA ? a + ((quad / 2) * 8 + row8) * lda + fm * 16 + (quad % 2) * 8
                          : a + (fm * 16 + (quad % 2) * 8 + row8) * lda + (quad / 2) * 8;
  const T* b_row = TransB ? b + (fn * 16 + (quad / 2) * 8 + row8) * ldb + (quad % 2) * 8
                          : b + ((quad % 2) * 8 + row8) * ldb + fn * 16 + (quad / 2) * 8;
  for (int kk = 0; kk < k; kk += 16) {
    unsigned fa[4], fb[4];
    detail::load_matrices<TransA>(fa, TransA ? a_row + kk * lda : a_row + kk);
    detail::load_matrices<!TransB>(fb, TransB ? b_row + kk : b_row + kk * ldb);
    detail::mma16816<T>(acc.x[0], fa, fb[0], fb[1]);
    detail::mma16816<T>(acc.x[1], fa, fb[2], fb[3]);
  }
}

// c [m][n] (fp32, ldc) = (or +=, when accumulate) A x B for A [m][k] (lda; stored [k][m] when
// TransA) and B [k][n] (ldb; stored [n][k] when TransB); m, n multiples of 16, k of the MMA depth,
// leading dimensions multiples of 8 elements and 16-byte aligned rows. The CTA's Warps warps share
// the 16 x 16 output tiles. 16-bit types run on mma_tile (WMMA's fragment loads were generic
// 32-bit loads); fp32 (tf32) on WMMA.
template <typename T, int Warps, bool TransA, bool TransB>
__device__ void gemm(const typename Mma<T>::elem* a, int lda, const typename Mma<T>::elem* b,
                     int ldb, float* c, int ldc, int m, int n, int k, bool accumulate) {
  const int warp = threadIdx.x / 32, tiles_n = n / 16, count = (m / 16) * tiles_n;
  for (int f = warp; f < count; f += Warps) {
    const int fm = f / tiles_n, fn = f % tiles_n;
    float* out = c + fm * 16 * ldc + fn * 16;
    if constexpr (std::is_same_v<T, float>) {
      using ALayout = std::conditional_t<TransA, wmma::col_major, wmma::row_major>;
      using BLayout = std::conditional_t<TransB, wmma::col_major, wmma::row_major>;
      FragC<T> acc;
      if (accumulate) {
        wmma::load_matrix_sync(acc, out, ldc, wmma::mem_row_major);
      } else {
        wmma::fill_fragment(acc, 0.f);
      }
      for (int kk = 0; kk < k; kk += Mma<T>::k) {
        FragA<T, ALayout> fa;
        FragB<T, BLayout> fb;
        load_fragment<T>(fa, TransA ? a + kk * lda + fm * 16 : a + fm * 16 * lda + kk, lda);
        load_fragment<T>(fb, TransB ? b + fn * 16 * ldb + kk : b + kk * ldb + fn * 16, ldb);
        wmma::mma_sync(acc, fa, fb, acc);
      }
      wmma::store_matrix_sync(out, acc, ldc, wmma::mem_row_major);
    } else {
      TileAccumulator acc;
      if (accumulate) {
        acc.load(out, ldc);
      } else {
        acc.zero();
      }
      mma_tile<T, TransA, TransB>(acc, a, lda, b, ldb, fm, fn, k);
      acc.store(out, ldc);
    }
  }
}

namespace detail {

// The Rows x Cols blocks of output tiles, one per warp at a time (see gemm_blocked).
// Out: float, or __nv_bfloat16 (then accumulate must be false).
template <typename T, int Warps, bool TransA, bool TransB, int Rows, int Cols, typename Out>
__device__ __forceinline__ void gemm_blocks(const T* a, int lda, const T* b, int ldb, Out* c,
                                            int ldc, int m, int n, int k, bool accumulate) {
  const int warp = threadIdx.x / 32, blocks_n = n / (16 * Cols);
  const int count = (m / (16 * Rows)) * blocks_n;
  for (int f = warp; f < count; f += Warps) {
    const int fm = (f / blocks_n) * Rows, fn = (f % blocks_n) * Cols;
    TileAccumulator acc[Rows][Cols];
#pragma unroll
    for (int i = 0; i < Rows; ++i) {
#pragma unroll
      for (int j = 0; j < Cols; ++j) {
        if constexpr (std::is_same_v<Out, float>) {
          if (accumulate) {
            acc[i][j].load(c + (fm + i) * 16 * ldc + (fn + j) * 16, ldc);
          } else {
            acc[i][j].zero();
          }
        } else {
          acc[i][j].zero();
        }
      }
    }
    mma_block<T, TransA, TransB, Rows, Cols>(acc, a, lda, b, ldb, fm, fn, k);
#pragma unroll
    for (int i = 0; i < Rows; ++i) {
#pragma unroll
      for (int j = 0; j < Cols; ++j) acc[i][j].store(c + (fm + i) * 16 * ldc + (fn + j) * 16, ldc);
    }
  }
}

}  // namespace detail

// gemm for 16-bit T with each warp taking blocks of 2 x 2 or 1 x 2 output tiles where there are
// at least MinBlocks such blocks (fewer shared-memory reads per product; MinBlocks < Warps
// leaves warps idle for that); single tiles otherwise.
template <typename T, int Warps, bool TransA, bool TransB, int MinBlocks = Warps>
__device__ void gemm_blocked(const typename Mma<T>::elem* a, int lda,
                             const typename Mma<T>::elem* b, int ldb, float* c, int ldc, int m,
                             int n, int k, bool accumulate) {
  if constexpr (std::is_same_v<T, float>) {
    gemm<T, Warps, TransA, TransB>(a, lda, b, ldb, c, ldc, m, n, k, accumulate);
  } else {
    const int tiles_m = m / 16, tiles_n = n / 16;
    if (tiles_m % 2 == 0 && tiles_n % 2 == 0 && (tiles_m / 2) * (tiles_n / 2) >= MinBlocks) {
      detail::gemm_blocks<T, Warps, TransA, TransB, 2, 2>(a, lda, b, ldb, c, ldc, m, n, k,
                                                          accumulate);
    } else if (tiles_n % 2 == 0 && tiles_m * (tiles_n / 2) >= MinBlocks) {
      detail::gemm_blocks<T, Warps, TransA, TransB, 1, 2>(a, lda, b, ldb, c, ldc, m, n, k,
                                                          accumulate);
    } else {
      gemm<T, Warps, TransA, TransB>(a, lda, b, ldb, c, ldc, m, n, k, accumulate);
    }
  }
}

// The same product written to a bf16 matrix (16-bit T; m and n multiples of 32 with at least
// MinBlocks 2 x 2 blocks, or n a multiple of 32; the block sizes every caller has).
template <typename T, int Warps, bool TransA, bool TransB, int MinBlocks = Warps>
__device__ void gemm_blocked(const typename Mma<T>::elem* a, int lda,
                             const typename Mma<T>::elem* b, int ldb, __nv_bfloat16* c, int ldc,
                             int m, int n, int k) {
  static_assert(!std::is_same_v<T, float>, "bf16 products of 16-bit inputs only");
  const int tiles_m = m / 16, tiles_n = n / 16;
  if (tiles_m % 2 == 0 && tiles_n % 2 == 0 && (tiles_m / 2) * (tiles_n / 2) >= MinBlocks) {
    detail::gemm_blocks<T, Warps, TransA, TransB, 2, 2>(a, lda, b, ldb, c, ldc, m, n, k, false);
  } else {
    detail::gemm_blocks<T, Warps, TransA, TransB, 1, 2>(a, lda, b, ldb, c, ldc, m, n, k, false);
  }
}

}  // namespace wmma_tiles
}  // namespace mhla_kernels
