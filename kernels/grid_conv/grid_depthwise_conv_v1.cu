// TEMPORARY (session 35): session 34's kernel, kept only for a same-call A/B (MHLA_GRID_CONV_V1=1).
#include "grid_conv/grid_depthwise_conv.h"

#include <algorithm>

#include "common/element_type.cuh"
#include "common/packed_access.cuh"

namespace mhla_kernels {
namespace {

constexpr int K = kGridConvKernel;
constexpr int kTaps = K * K;
constexpr int kTokensPerCta = 64;  // a run of tokens: one neighbour table per CTA
constexpr int kLanes = 8;          // threads per channel vector, each every kLanes-th token
constexpr int kMaxVectors = 16;    // channel vectors per CTA (the slice)
constexpr int kZeroBytes = 64 * 1024;
constexpr int kSumRows = 8;  // row groups of the partials' sum (one warp each)

// What a tap outside the grid reads: one zero row (static device memory starts zeroed), so that
// every load is unconditional and a token's loads go out together.
__device__ __align__(16) unsigned char zero_row[kZeroBytes];

// Channels per thread: 16 bytes in the forward; 4 in the backward, whose nine fp32 dw sums per
// channel would otherwise take most of the registers (255 with 8 bf16 channels: 9 % occupancy).
template <typename T, bool Backward>
constexpr int vector_of() {
  return Backward ? 4 : 16 / static_cast<int>(sizeof(T));
}

// The CTA's slices of the channel vectors: the fewest slices of at most kMaxVectors, as even as
// they come (24 vectors: two of 12).
struct Slicing {
  int vectors, slices, per_slice;
  __host__ __device__ Slicing(int channels, int vec) : vectors(channels / vec) {
    slices = (vectors + kMaxVectors - 1) / kMaxVectors;
    per_slice = (vectors + slices - 1) / slices;
  }
};

// Block-major token t <-> grid position. The neighbour table of a run holds, per token and tap
// (tap i * 3 + j: the position (y + i - 1, x + j - 1)), the neighbour's token, or -1 outside
// the grid. One thread per token: three divisions for its position, none per tap.
struct BlockGrid {
  int grid_h, grid_w, tile_h, tile_w, tiles_w, tile_size;
  __host__ __device__ explicit BlockGrid(const GridConvArgs& a)
      : grid_h(a.grid_h),
        grid_w(a.grid_w),
        tile_h(a.grid_h / a.tiles_h),
        tile_w(a.grid_w / a.tiles_w),
        tiles_w(a.tiles_w),
        tile_size(tile_h * tile_w) {}
  __device__ void neighbours(int t, int* entries) const {
    const int block = t / tile_size, within = t - block * tile_size;
    const int by = block / tiles_w, bx = block - by * tiles_w;
    const int wy = within / tile_w, wx = within - wy * tile_w;
    const int y = by * tile_h + wy, x = bx * tile_w + wx;
#pragma unroll
    for (int i = 0; i < K; ++i) {
      // The row's tile and row inside it, stepping over a tile edge without dividing.
      int ty = by, ry = wy + i - 1;
      if (ry < 0) --ty, ry += tile_h;
      if (ry >= tile_h) ++ty, ry -= tile_h;
#pragma unroll
      for (int j = 0; j < K; ++j) {
        int tx = bx, rx = wx + j - 1;
        if (rx < 0) --tx, rx += tile_w;
        if (rx >= tile_w) ++tx, rx -= tile_w;
        const bool inside =
            y + i - 1 >= 0 && y + i - 1 < grid_h && x + j - 1 >= 0 && x + j - 1 < grid_w;
        entries[i * K + j] = inside ? (ty * tiles_w + tx) * tile_size + ry * tile_w + rx : -1;
      }
    }
  }
};

// What every CTA of both passes sets up: its image, run and channel slice, the neighbour table of
// its run and its slice of the weights, in shared memory.
template <int Vec>
struct Cta {
  int b, run0, run_tokens, vector, channel;
  bool live;      // this thread has a channel vector (the last slice may be narrower)
  int* table;     // [kTokensPerCta][kTaps]
  float* weight;  // [kTaps][per_slice * Vec]

  __device__ Cta(const GridConvArgs& a, unsigned char* smem) {
    const Slicing slicing(a.channels, Vec);
    const int tokens = a.grid_h * a.grid_w;
    b = blockIdx.y;
    run0 = blockIdx.x * kTokensPerCta;
    run_tokens = min(kTokensPerCta, tokens - run0);
    vector = blockIdx.z * slicing.per_slice + threadIdx.x;
    live = threadIdx.x < slicing.per_slice && vector < slicing.vectors;
    channel = vector * Vec;
    table = reinterpret_cast<int*>(smem);
    weight = reinterpret_cast<float*>(smem + kTokensPerCta * kTaps * sizeof(int));
    const int threads = blockDim.x * blockDim.y, me = threadIdx.y * blockDim.x + threadIdx.x;
    const BlockGrid grid(a);
    for (int local = me; local < run_tokens; local += threads)
      grid.neighbours(run0 + local, table + local * kTaps);
    const int width = blockDim.x * Vec, first = blockIdx.z * slicing.per_slice * Vec;
    for (int e = me; e < kTaps * width; e += threads) {
      const int tap = e / width, c = first + e % width;
      weight[e] = c < a.channels ? a.weight[c * kTaps + tap] : 0.f;
    }
    __syncthreads();
  }
  __device__ void weights(int tap, float (&w)[Vec]) const {
#pragma unroll
    for (int e = 0; e < Vec; e += 4) {
      const float4 q =
          *reinterpret_cast<const float4*>(weight + tap * blockDim.x * Vec + threadIdx.x * Vec + e);
      w[e] = q.x, w[e + 1] = q.y, w[e + 2] = q.z, w[e + 3] = q.w;
    }
  }
};

size_t cta_smem_bytes(int per_slice, int vec) {
  return kTokensPerCta * kTaps * sizeof(int) + static_cast<size_t>(kTaps) * per_slice * vec * 4;
}

// The row a table entry names: token `entry` of a [tokens][stride] image, or the zero row.
template <typename T>
__device__ __forceinline__ const T* row_of(const T* image, int entry, int64_t stride, int channel) {
  return entry >= 0 ? image + entry * stride : reinterpret_cast<const T*>(zero_row) + channel;
}

template <typename T>
__global__ void __launch_bounds__(kMaxVectors* kLanes) forward_kernel(GridConvArgs a) {
  extern __shared__ __align__(16) unsigned char smem[];
  constexpr int vec = vector_of<T, false>();
  const Cta<vec> cta(a, smem);
  if (!cta.live) return;
  const T* x = static_cast<const T*>(a.x) + cta.b * a.x_batch_stride + cta.channel;
  const int tokens = a.grid_h * a.grid_w;
  T* out =
      static_cast<T*>(a.out) + (static_cast<int64_t>(cta.b) * tokens) * a.channels + cta.channel;
  float bias[vec];
#pragma unroll
  for (int e = 0; e < vec; ++e) bias[e] = a.bias != nullptr ? a.bias[cta.channel + e] : 0.f;
  for (int local = threadIdx.y; local < cta.run_tokens; local += kLanes) {
    const int* entries = cta.table + local * kTaps;
    float v[kTaps][vec];  // every tap's load first: they are in flight together
#pragma unroll
    for (int tap = 0; tap < kTaps; ++tap)
      load_pack<T, vec>(row_of(x, entries[tap], a.x_token_stride, cta.channel), v[tap]);
    float acc[vec];
#pragma unroll
    for (int e = 0; e < vec; ++e) acc[e] = bias[e];
#pragma unroll
    for (int tap = 0; tap < kTaps; ++tap) {
      float w[vec];
      cta.weights(tap, w);
#pragma unroll
      for (int e = 0; e < vec; ++e) acc[e] = fmaf(w[e], v[tap][e], acc[e]);
    }
    store_pack<T, vec>(out + static_cast<int64_t>(cta.run0 + local) * a.channels, acc);
  }
}

// dx by the mirrored gather, and this CTA's part of dw and dbias: each thread sums its tokens,
// then the kLanes threads of a channel vector add theirs in shared memory (over the table, which
// is no longer read) and the CTA writes one [kTaps + 1][C] partial into the workspace.
template <typename T>
__global__ void __launch_bounds__(kMaxVectors* kLanes) backward_kernel(GridConvArgs a) {
  extern __shared__ __align__(16) unsigned char smem[];
  constexpr int vec = vector_of<T, true>();
  const Cta<vec> cta(a, smem);
  const int tokens = a.grid_h * a.grid_w;
  const int64_t image = static_cast<int64_t>(cta.b) * tokens * a.channels;
  const T* x = static_cast<const T*>(a.x) + cta.b * a.x_batch_stride + cta.channel;
  const T* dout = static_cast<const T*>(a.dout) + image + cta.channel;
  T* dx = static_cast<T*>(a.dx) + image + cta.channel;
  float dw[kTaps][vec] = {}, db[vec] = {};
  if (cta.live) {
    for (int local = threadIdx.y; local < cta.run_tokens; local += kLanes) {
      const int t = cta.run0 + local;
      const int* entries = cta.table + local * kTaps;
      float g[vec], acc[vec] = {};
      load_pack<T, vec>(dout + static_cast<int64_t>(t) * a.channels, g);
#pragma unroll
      for (int e = 0; e < vec; ++e) db[e] += g[e];
#pragma unroll
      for (int tap = 0; tap < kTaps; ++tap) {
        // out at t read x at its neighbour `tap`; x at t fed the output at its mirrored
        // neighbour with the weight of `tap` (outside the grid: the zero row).
        float v[vec], h[vec], w[vec];
        load_pack<T, vec>(row_of(x, entries[tap], a.x_token_stride, cta.channel), v);
        load_pack<T, vec>(row_of(dout, entries[kTaps - 1 - tap], a.channels, cta.channel), h);
        cta.weights(tap, w);
#pragma unroll
        for (int e = 0; e < vec; ++e) {
          dw[tap][e] = fmaf(g[e], v[e], dw[tap][e]);
          acc[e] = fmaf(w[e], h[e], acc[e]);
        }
      }
      store_pack<T, vec>(dx + static_cast<int64_t>(t) * a.channels, acc);
    }
  }
  // The lanes' sums: [kTaps + 1][kLanes][width] floats over the table and the weights (both
  // done with), then each (row, vector) added over the lanes in lane order.
  __syncthreads();
  const int width = blockDim.x * vec;
  float* sums = reinterpret_cast<float*>(smem);
  auto slot = [&](int row, int lane) {
    return sums + (row * kLanes + lane) * width + threadIdx.x * vec;
  };
#pragma unroll
  for (int row = 0; row <= kTaps; ++row) {
    float* to = slot(row, threadIdx.y);
#pragma unroll
    for (int e = 0; e < vec; ++e) to[e] = row < kTaps ? dw[row][e] : db[e];
  }
  __syncthreads();
  if (!cta.live) return;
  const int part = blockIdx.y * gridDim.x + blockIdx.x;  // the partial's row: image-major
  float* partial = a.workspace + static_cast<int64_t>(part) * (kTaps + 1) * a.channels;
  for (int row = threadIdx.y; row <= kTaps; row += kLanes) {
    float total[vec] = {};
    for (int lane = 0; lane < kLanes; ++lane) {
      const float* from = slot(row, lane);
#pragma unroll
      for (int e = 0; e < vec; ++e) total[e] += from[e];
    }
#pragma unroll
    for (int e = 0; e < vec; ++e) partial[row * a.channels + cta.channel + e] = total[e];
  }
}

// dw and dbias: the CTAs' partials summed in a fixed order. A CTA takes 32 consecutive outputs;
// warp r sums rows r, r + kSumRows, ... (coalesced across its lanes), then lane order is fixed
// by adding the warps' sums in warp order.
__global__ void __launch_bounds__(32 * kSumRows) sum_partials_kernel(GridConvArgs a, int parts) {
  __shared__ float part_sums[kSumRows][32];
  const int outputs = (kTaps + 1) * a.channels;
  const int e = blockIdx.x * 32 + threadIdx.x % 32, group = threadIdx.x / 32;
  float total = 0.f;
  if (e < outputs) {
    for (int p = group; p < parts; p += kSumRows) total += a.workspace[int64_t{p} * outputs + e];
  }
  part_sums[group][threadIdx.x % 32] = total;
  __syncthreads();
  if (group != 0 || e >= outputs) return;
  total = 0.f;
#pragma unroll
  for (int g = 0; g < kSumRows; ++g) total += part_sums[g][threadIdx.x];
  const int row = e / a.channels, c = e % a.channels;
  if (row < kTaps) {
    a.dweight[c * kTaps + row] = total;
  } else if (a.dbias != nullptr) {
    a.dbias[c] = total;
  }
}

int vector_of(DType dtype, bool backward) {
  return backward ? 4 : (dtype == DType::f32 ? 4 : 8);
}

dim3 grid_of(const GridConvArgs& a, bool backward) {
  const Slicing slicing(a.channels, vector_of(a.dtype, backward));
  const int tokens = a.grid_h * a.grid_w;
  return dim3((tokens + kTokensPerCta - 1) / kTokensPerCta, a.batch, slicing.slices);
}

template <typename Kernel>
cudaError_t launch(Kernel kernel, const GridConvArgs& a, bool backward, size_t smem,
                   cudaStream_t stream) {
  const Slicing slicing(a.channels, vector_of(a.dtype, backward));
  if (smem > 48 * 1024) {
    const cudaError_t err = cudaFuncSetAttribute(
        kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (err != cudaSuccess) return err;
  }
  kernel<<<grid_of(a, backward), dim3(slicing.per_slice, kLanes), smem, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace

bool grid_conv_supported_v1(const GridConvArgs& a) {
  const int vec = vector_of(a.dtype, false);  // the backward's 4 divides it too
  if (a.batch <= 0 || a.channels <= 0 || a.channels % vec != 0) return false;
  const int bytes = a.dtype == DType::f32 ? 4 : 2;
  if (static_cast<int64_t>(a.channels) * bytes > kZeroBytes) return false;
  if (a.grid_h <= 0 || a.grid_w <= 0 || a.tiles_h <= 0 || a.tiles_w <= 0) return false;
  if (a.grid_h % a.tiles_h != 0 || a.grid_w % a.tiles_w != 0) return false;
  const int64_t tokens = static_cast<int64_t>(a.grid_h) * a.grid_w;
  return a.batch <= 65535 && tokens * a.channels <= INT32_MAX &&
         (tokens + kTokensPerCta - 1) / kTokensPerCta <= INT32_MAX;
}

size_t grid_conv_workspace_floats_v1(const GridConvArgs& a) {
  const dim3 grid = grid_of(a, true);
  return static_cast<size_t>(grid.x) * grid.y * (kTaps + 1) * a.channels;
}

cudaError_t grid_conv_forward_v1(const GridConvArgs& a, cudaStream_t stream) {
  if (!grid_conv_supported_v1(a) || a.x == nullptr || a.weight == nullptr || a.out == nullptr)
    return cudaErrorInvalidValue;
  const int vec = vector_of(a.dtype, false);
  const size_t smem = cta_smem_bytes(Slicing(a.channels, vec).per_slice, vec);
  return with_element_type(a.dtype, [&](auto zero) {
    using T = decltype(zero);
    return launch(forward_kernel<T>, a, false, smem, stream);
  });
}

cudaError_t grid_conv_backward_v1(const GridConvArgs& a, cudaStream_t stream) {
  if (!grid_conv_supported_v1(a) || a.x == nullptr || a.weight == nullptr || a.dout == nullptr ||
      a.dx == nullptr || a.dweight == nullptr || a.workspace == nullptr)
    return cudaErrorInvalidValue;
  const int vec = vector_of(a.dtype, true);
  const Slicing slicing(a.channels, vec);
  // The lanes' sums reuse the table and weight space; the larger of the two uses.
  const size_t sums = static_cast<size_t>(kTaps + 1) * kLanes * slicing.per_slice * vec * 4;
  const size_t smem = std::max(cta_smem_bytes(slicing.per_slice, vec), sums);
  const cudaError_t err = with_element_type(a.dtype, [&](auto zero) {
    using T = decltype(zero);
    return launch(backward_kernel<T>, a, true, smem, stream);
  });
  if (err != cudaSuccess) return err;
  const dim3 grid = grid_of(a, true);
  const int outputs = (kTaps + 1) * a.channels;
  sum_partials_kernel<<<(outputs + 31) / 32, 32 * kSumRows, 0, stream>>>(
      a, static_cast<int>(grid.x * grid.y));
  return cudaGetLastError();
}

}  // namespace mhla_kernels
