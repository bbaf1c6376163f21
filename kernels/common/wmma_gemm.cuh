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

// c [m][n] (fp32, ldc) = (or +=, when accumulate) A x B for A [m][k] (lda; stored [k][m] when
// TransA) and B [k][n] (ldb; stored [n][k] when TransB); m, n multiples of 16, k of the MMA depth.
// The CTA's Warps warps share the 16 x 16 output tiles.
template <typename T, int Warps, bool TransA, bool TransB>
__device__ void gemm(const typename Mma<T>::elem* a, int lda, const typename Mma<T>::elem* b,
                     int ldb, float* c, int ldc, int m, int n, int k, bool accumulate) {
  using ALayout = std::conditional_t<TransA, wmma::col_major, wmma::row_major>;
  using BLayout = std::conditional_t<TransB, wmma::col_major, wmma::row_major>;
  const int warp = threadIdx.x / 32, tiles_n = n / 16, count = (m / 16) * tiles_n;
  for (int f = warp; f < count; f += Warps) {
    const int fm = f / tiles_n, fn = f % tiles_n;
    float* out = c + fm * 16 * ldc + fn * 16;
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
  }
}

}  // namespace wmma_tiles
}  // namespace mhla_kernels
