#pragma once
// Building blocks shared by the block-linear-attention kernels: tensor-core element types and
// fragments per input dtype, the shared-memory layout of one head dimension, vector loads of
// token rows, the feature map phi(x) = relu(x / rms(x)) + floor applied while loading (and its
// backward), shared-memory opt-in and the dtype x head-dim dispatch.
#include <mma.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstddef>
#include <type_traits>

#include "common/element_type.cuh"
#include "common/wmma_gemm.cuh"
#include "mhla/block_linear_attention.h"

namespace mhla_kernels {
namespace tiles {

using namespace nvcuda;
using mhla_kernels::wmma_tiles::FragA;
using mhla_kernels::wmma_tiles::FragB;
using mhla_kernels::wmma_tiles::FragC;
using mhla_kernels::wmma_tiles::load_fragment;
using mhla_kernels::wmma_tiles::Mma;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kTile = 64;          // tokens per shared-memory tile
constexpr int kChunk = 4 * kTile;  // tokens per CTA along a block
constexpr int kMixColumns = 64;    // state elements per step of the mixing backward
constexpr float kFeatureFloor = 1e-6f;
constexpr float kNormEps = 1e-6f;
constexpr float kDenominatorEps = 1e-6f;

// Compile-time layout of one head dimension: padded leading dimensions (against bank conflicts,
// keeping every 16-row fragment 32-byte aligned) and the vector loads of one token row. Threads:
// the CTA size of the kernel using it (kThreads unless the kernel family picks its own).
template <typename T, int D, int Threads = kThreads>
struct Layout {
  using E = typename Mma<T>::elem;
  static constexpr int lde = D + 8;           // elements, tiles of E
  static constexpr int ldf = D + 4;           // floats, fp32 tiles
  static constexpr int vec = 16 / sizeof(T);  // elements per 16-byte load
  static constexpr int lanes = D / vec;       // threads per token row (4 to 32)
  static constexpr int rows_per_pass = Threads / lanes;
  static constexpr int frags = (D / 16) * (D / 16);  // D x D accumulators
  static constexpr int frags_per_warp = (frags + Threads / 32 - 1) / (Threads / 32);
  static constexpr int state = D * D + D;  // floats of S_j followed by z_j
};

struct Vec {
  float x[8];
};

template <typename T, int D>
__device__ __forceinline__ const T* token_row(const TokenTensor& t, int b, int n, int h) {
  return static_cast<const T*>(t.data) + b * t.batch_stride + n * t.token_stride +
         h * t.head_stride;
}

// One 16-byte piece of a row to fp32 and back (16-bit T: in element pairs, element_type.cuh).
template <typename T, int D>
__device__ __forceinline__ void load_vector(const T* p, float* x) {
  constexpr int vec = Layout<T, D>::vec;
  uint4 raw = *reinterpret_cast<const uint4*>(p);
  if constexpr (sizeof(T) == 2) {
    const unsigned* words = reinterpret_cast<const unsigned*>(&raw);
#pragma unroll
    for (int i = 0; i < vec / 2; ++i) unpack_pair<T>(words[i], x[2 * i], x[2 * i + 1]);
  } else {
    const T* values = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int i = 0; i < vec; ++i) x[i] = to_float(values[i]);
  }
}

template <typename T, int D>
__device__ __forceinline__ void store_vector(T* p, const float* x) {
  constexpr int vec = Layout<T, D>::vec;
  uint4 raw;
  if constexpr (sizeof(T) == 2) {
    unsigned* words = reinterpret_cast<unsigned*>(&raw);
#pragma unroll
    for (int i = 0; i < vec / 2; ++i) words[i] = pack_pair<T>(x[2 * i], x[2 * i + 1]);
  } else {
    T* values = reinterpret_cast<T*>(&raw);
#pragma unroll
    for (int i = 0; i < vec; ++i) values[i] = from_float<T>(x[i]);
  }
  *reinterpret_cast<uint4*>(p) = raw;
}

// Sum over the threads of one token row (a power-of-two group inside a warp).
template <int Lanes>
__device__ __forceinline__ float row_sum(float x) {
#pragma unroll
  for (int offset = Lanes / 2; offset > 0; offset /= 2)
    x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

// The token rows of one tile held by this thread as raw 16-byte words: load() issues every row's
// load before any is used, so a kernel can start the loads of several tiles (and of a state)
// and wait for them once, instead of one global-memory latency per pass over the rows.
template <typename T, int D, int Threads = kThreads>
struct TileRows {
  using L = Layout<T, D, Threads>;
  static constexpr int passes = (kTile + L::rows_per_pass - 1) / L::rows_per_pass;
  uint4 raw[passes];

  __device__ __forceinline__ static int row(int pass) {
    return threadIdx.x / L::lanes + pass * L::rows_per_pass;
  }

  // Rows r < valid from token n0 on; rows valid <= r < rows are zero.
  __device__ __forceinline__ void load(const TokenTensor& src, int b, int h, int n0, int valid,
                                       int rows) {
    const int lane = threadIdx.x % L::lanes;
#pragma unroll
    for (int pass = 0; pass < passes; ++pass) {
      const int r = row(pass);
      raw[pass] = make_uint4(0u, 0u, 0u, 0u);  // zero bits: 0.0 in every element type
      if (r < valid && r < rows) {
        raw[pass] =
            *reinterpret_cast<const uint4*>(token_row<T, D>(src, b, n0 + r, h) + lane * L::vec);
      }
    }
  }

  // Rows r < valid of a contiguous [B, T, H, D] tensor (the binding's outputs and gradients).
  __device__ __forceinline__ void load_contiguous(const T* base, int tokens, int heads, int b,
                                                  int h, int n0, int valid) {
    const int lane = threadIdx.x % L::lanes;
#pragma unroll
    for (int pass = 0; pass < passes; ++pass) {
      const int r = row(pass);
      raw[pass] = make_uint4(0u, 0u, 0u, 0u);
      if (r < valid) {
        const size_t at = ((static_cast<size_t>(b) * tokens + n0 + r) * heads + h) * D;
        raw[pass] = *reinterpret_cast<const uint4*>(base + at + lane * L::vec);
      }
    }
  }

  __device__ __forceinline__ void values(int pass, float* x) const {
    const T* v = reinterpret_cast<const T*>(&raw[pass]);
#pragma unroll
    for (int i = 0; i < L::vec; ++i) x[i] = to_float(v[i]);
  }

  // phi(x) of the rows into dst (rows valid <= r < `rows` zero: the padding must be zero, not
  // the feature floor); 1/rms per row into inv_rms when asked. `rows` <= kTile, a multiple of 16.
  __device__ void store_features(int valid, int rows, typename Mma<T>::elem* dst,
                                 float* inv_rms) const {
    const int lane = threadIdx.x % L::lanes;
#pragma unroll
    for (int pass = 0; pass < passes; ++pass) {
      const int r = row(pass);
      if (r >= rows) break;  // uniform over the row's lanes
      float x[L::vec];
      values(pass, x);
      float squares = 0.f;
#pragma unroll
      for (int i = 0; i < L::vec; ++i) squares += x[i] * x[i];
      const float scale = rsqrtf(row_sum<L::lanes>(squares) / D + kNormEps);
#pragma unroll
      for (int i = 0; i < L::vec; ++i) {
        const float phi = r < valid ? fmaxf(x[i] * scale, 0.f) + kFeatureFloor : 0.f;
        dst[r * L::lde + lane * L::vec + i] = from_float<typename Mma<T>::elem>(phi);
      }
      if (inv_rms != nullptr && lane == 0) inv_rms[r] = scale;
    }
  }

  __device__ void store_plain(int rows, typename Mma<T>::elem* dst) const {
    const int lane = threadIdx.x % L::lanes;
#pragma unroll
    for (int pass = 0; pass < passes; ++pass) {
      const int r = row(pass);
      if (r >= rows) break;
      float x[L::vec];
      values(pass, x);
#pragma unroll
      for (int i = 0; i < L::vec; ++i)
        dst[r * L::lde + lane * L::vec + i] = from_float<typename Mma<T>::elem>(x[i]);
    }
  }
};

// phi(x) of `valid` token rows starting at token n0 into dst (rows up to `rows` <= kTile
// zero-filled); 1/rms per row into inv_rms when asked.
template <typename T, int D, int Threads = kThreads>
__device__ void load_features(const TokenTensor& src, int b, int h, int n0, int valid, int rows,
                              typename Mma<T>::elem* dst, float* inv_rms) {
  TileRows<T, D, Threads> tile;
  tile.load(src, b, h, n0, valid, rows);
  tile.store_features(valid, rows, dst, inv_rms);
}

template <typename T, int D, int Threads = kThreads>
__device__ void load_plain(const TokenTensor& src, int b, int h, int n0, int valid, int rows,
                           typename Mma<T>::elem* dst) {
  TileRows<T, D, Threads> tile;
  tile.load(src, b, h, n0, valid, rows);
  tile.store_plain(rows, dst);
}

// Backward of phi = relu(x / rms(x)) + floor for one token row held by L::lanes threads:
// g is d(loss)/d(phi) for this thread's elements; returns d(loss)/dx in place.
template <typename T, int D, int Threads = kThreads>
__device__ __forceinline__ void feature_backward(const float* x, float scale, float* g) {
  using L = Layout<T, D, Threads>;
  float dot = 0.f;
#pragma unroll
  for (int i = 0; i < L::vec; ++i) {
    const float y = x[i] * scale;
    g[i] = y > 0.f ? g[i] : 0.f;
    dot += g[i] * y;
  }
  dot = row_sum<L::lanes>(dot) / D;
#pragma unroll
  for (int i = 0; i < L::vec; ++i) g[i] = scale * (g[i] - x[i] * scale * dot);
}

__host__ __device__ constexpr size_t align128(size_t bytes) {
  return (bytes + 127) / 128 * 128;
}

// Carves consecutive 128-byte aligned regions out of dynamic shared memory, in order.
struct Carver {
  unsigned char* cursor;
  template <typename X>
  __device__ __forceinline__ X* take(size_t bytes) {
    X* at = reinterpret_cast<X*>(cursor);
    cursor += align128(bytes);
    return at;
  }
};

// Opts a kernel into the shared memory it needs (above the default 48 KiB), once.
template <typename Kernel>
cudaError_t allow_smem(Kernel kernel, size_t bytes) {
  if (bytes <= 48 * 1024) return cudaSuccess;
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                              static_cast<int>(bytes));
}

// Picks the instantiation for the runtime dtype and head dimension.
template <typename Args>
using Launcher = cudaError_t (*)(const Args&, cudaStream_t);

template <typename Args, template <typename, int> class Pass>
Launcher<Args> launcher_for(DType dtype, int head_dim) {
  auto by_dim = [&](auto tag) -> Launcher<Args> {
    using T = decltype(tag);
    switch (head_dim) {
      case 32:
        return &Pass<T, 32>::run;
      case 64:
        return &Pass<T, 64>::run;
      case 128:
        return &Pass<T, 128>::run;
      default:
        return nullptr;
    }
  };
  switch (dtype) {
    case DType::f32:
      return by_dim(float{});
    case DType::f16:
      return by_dim(__half{});
    case DType::bf16:
      return by_dim(__nv_bfloat16{});
  }
  return nullptr;
}

}  // namespace tiles
}  // namespace mhla_kernels
