#include "grid_conv/grid_depthwise_conv.h"

#include "common/async_copy.cuh"
#include "common/element_type.cuh"
#include "common/packed_access.cuh"
#include "common/partial_sums.cuh"

namespace mhla_kernels {
namespace {

constexpr int K = kGridConvKernel;
constexpr int kTaps = K * K;
constexpr int kChunkBytes = 128;  // a CTA's channels: one 128-byte piece of every token's row
constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
// Shared memory a CTA's band may take: the small budget keeps four CTAs on an SM; wide grids,
// whose three rows (one plus the halo) do not fit in it, take the large one.
constexpr int kSmallBudget = 48 * 1024;
constexpr int kLargeBudget = 200 * 1024;

constexpr int align16(int bytes) {
  return (bytes + 15) / 16 * 16;
}

// How the grid is cut into bands of whole rows, each staged with a one-row halo above and below
// and a one-column halo left and right (zeros outside the grid) as a raster tile of
// (rows + 2) x (grid_w + 2) cells of 128 bytes. `staged`: tiles per CTA (the forward stages x,
// the backward x and dout).
struct Banding {
  int rows = 0, bands = 0, width = 0, cells = 0, smem = 0;
  __host__ __device__ Banding(const GridConvArgs& a, int staged) {
    width = a.grid_w + 2;
    const int grid_h = a.grid_h;
    const int cell_bytes = staged * kChunkBytes + 4;  // the tiles and the token table
    int fit = kSmallBudget / (width * cell_bytes) - 2;
    if (fit < 1) fit = kLargeBudget / (width * cell_bytes) - 2;
    if (fit < 1) return;  // rows == 0: not supported
    bands = (grid_h + fit - 1) / fit;
    rows = (grid_h + bands - 1) / bands;  // as even as they come
    cells = (rows + 2) * width;
    // The backward reuses the tiles for the warps' weight-gradient sums (fp32, up to 64
    // channels a row), which may be larger on small grids.
    const int tiles = staged * cells * kChunkBytes, sums = kWarps * (kTaps + 1) * 64 * 4;
    smem = align16(cells * 4) + (staged == 2 && sums > tiles ? sums : tiles);
  }
};

// Block-major token index of grid position (y, x), or -1 outside the grid.
struct BlockGrid {
  int grid_h, grid_w, tile_h, tile_w, tiles_w;
  __host__ __device__ explicit BlockGrid(const GridConvArgs& a)
      : grid_h(a.grid_h),
        grid_w(a.grid_w),
        tile_h(a.grid_h / a.tiles_h),
        tile_w(a.grid_w / a.tiles_w),
        tiles_w(a.tiles_w) {}
  __device__ int token(int y, int x) const {
    if (y < 0 || y >= grid_h || x < 0 || x >= grid_w) return -1;
    const int by = y / tile_h, bx = x / tile_w;
    return ((by * tiles_w + bx) * tile_h + (y - by * tile_h)) * tile_w + (x - bx * tile_w);
  }
};

// One CTA's band of one image and one 128-byte channel chunk: the token table of its raster
// cells and the staged tiles in shared memory.
template <typename T>
struct BandCta {
  static constexpr int kChunk = kChunkBytes / static_cast<int>(sizeof(T));  // elements
  int b, y0, rows, c0, chunk;  // chunk: channels of this chunk (the last one may be narrower)
  Banding banding;
  int* table;  // [cells]: the token at each raster cell, or -1 (a zero cell)

  __device__ BandCta(const GridConvArgs& a, const Banding& band, unsigned char* smem)
      : banding(band) {
    const int chunks = (a.channels + kChunk - 1) / kChunk;
    const int band_index = blockIdx.x / chunks, chunk_index = blockIdx.x % chunks;
    b = blockIdx.y;
    y0 = band_index * band.rows;
    rows = min(band.rows, a.grid_h - y0);
    c0 = chunk_index * kChunk;
    chunk = min(kChunk, a.channels - c0);
    table = reinterpret_cast<int*>(smem);
    const BlockGrid grid(a);
    for (int cell = threadIdx.x; cell < band.cells; cell += kThreads) {
      const int ry = cell / band.width, rx = cell - ry * band.width;
      // Cells past this band's last row (the last band may be shorter) stay zero.
      table[cell] = ry <= rows + 1 ? grid.token(y0 + ry - 1, rx - 1) : -1;
    }
    __syncthreads();
  }
  __device__ T* tile(unsigned char* smem, int which) const {
    return reinterpret_cast<T*>(smem + align16(banding.cells * 4) +
                                static_cast<size_t>(which) * banding.cells * kChunkBytes);
  }
  // Copies every raster cell's 128-byte piece of `image` ([tokens][token_stride] elements) into
  // `to` with cp.async, 16 bytes a copy; zero cells and channels past the chunk are zero-filled.
  __device__ void stage(const T* image, int64_t token_stride, T* to) const {
    constexpr int per_cell = kChunkBytes / 16, vec = 16 / static_cast<int>(sizeof(T));
    const int live = chunk / vec;
    for (int e = threadIdx.x; e < banding.cells * per_cell; e += kThreads) {
      const int cell = e / per_cell, piece = e % per_cell, token = table[cell];
      const bool valid = token >= 0 && piece < live;
      const T* from = image + (valid ? token * token_stride + c0 + piece * vec : 0);
      async_copy::copy_streaming16(to + cell * kChunk + piece * vec, from, valid);
    }
    async_copy::commit();
  }
  // The raster cell of band position p (row-major over the band's rows).
  __device__ int cell_of(int p, int grid_w) const {
    const int y = p / grid_w, x = p - y * grid_w;
    return (y + 1) * banding.width + x + 1;
  }
};

// Channels c .. c + Vec - 1 of the [C, kTaps] weights as w[tap][channel]: Vec * kTaps consecutive
// floats, 16-byte aligned (c is a multiple of 4), read as float4s.
template <int Vec>
__device__ __forceinline__ void load_weights(const float* weight, int c, bool live,
                                             float (&w)[kTaps][Vec]) {
  static_assert(Vec % 4 == 0, "whole float4s");
  if (!live) {
#pragma unroll
    for (int tap = 0; tap < kTaps; ++tap) {
#pragma unroll
      for (int e = 0; e < Vec; ++e) w[tap][e] = 0.f;
    }
    return;
  }
  const float4* from = reinterpret_cast<const float4*>(weight + c * kTaps);
#pragma unroll
  for (int q = 0; q < Vec * kTaps / 4; ++q) {
    const float4 f = from[q];
    const float parts[4] = {f.x, f.y, f.z, f.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int flat = 4 * q + i;  // channel flat / kTaps, tap flat % kTaps
      w[flat % kTaps][flat / kTaps] = parts[i];
    }
  }
}

// out at each position of the band: base (if any), bias and nine taps of the staged x tile. A
// thread owns one 16-byte channel vector of the chunk (its 9 x vec weights stay in registers) and
// every 16th position.
template <typename T>
__global__ void __launch_bounds__(kThreads) forward_kernel(GridConvArgs a, Banding band) {
  extern __shared__ __align__(16) unsigned char smem[];
  constexpr int vec = 16 / static_cast<int>(sizeof(T)), lanes = kChunkBytes / 16;
  const BandCta<T> cta(a, band, smem);
  T* xs = cta.tile(smem, 0);
  cta.stage(static_cast<const T*>(a.x) + cta.b * a.x_batch_stride, a.x_token_stride, xs);
  const int lane = threadIdx.x % lanes, c = cta.c0 + lane * vec;
  const bool live = lane * vec < cta.chunk;
  float w[kTaps][vec], bias[vec];
  load_weights<vec>(a.weight, c, live, w);
#pragma unroll
  for (int e = 0; e < vec; ++e) bias[e] = live && a.bias != nullptr ? a.bias[c + e] : 0.f;
  async_copy::wait<0>();
  __syncthreads();
  if (!live) return;
  const int tokens = a.grid_h * a.grid_w, width = band.width;
  const int64_t image = static_cast<int64_t>(cta.b) * tokens * a.channels + c;
  T* out = static_cast<T*>(a.out) + image;
  const T* base = a.base != nullptr ? static_cast<const T*>(a.base) + image : nullptr;
  for (int p = threadIdx.x / lanes; p < cta.rows * a.grid_w; p += kThreads / lanes) {
    const int cell = cta.cell_of(p, a.grid_w);
    const T* center = xs + cell * BandCta<T>::kChunk + lane * vec;
    // Every tap's load first, so they are in flight together; kept packed until used.
    Pack<T, vec> v[kTaps];
#pragma unroll
    for (int tap = 0; tap < kTaps; ++tap)
      v[tap] = *reinterpret_cast<const Pack<T, vec>*>(
          center + ((tap / K - 1) * width + tap % K - 1) * BandCta<T>::kChunk);
    const int64_t row = static_cast<int64_t>(cta.table[cell]) * a.channels;
    float acc[vec];
    if (base != nullptr) {
      load_pack<T, vec>(base + row, acc);
#pragma unroll
      for (int e = 0; e < vec; ++e) acc[e] += bias[e];
    } else {
#pragma unroll
      for (int e = 0; e < vec; ++e) acc[e] = bias[e];
    }
#pragma unroll
    for (int tap = 0; tap < kTaps; ++tap) {
#pragma unroll
      for (int e = 0; e < vec; ++e) acc[e] = fmaf(w[tap][e], to_float(v[tap].v[e]), acc[e]);
    }
    store_pack<T, vec>(out + row, acc);
  }
}

// dx by the mirrored taps of the staged dout tile, and this CTA's part of dw and dbias: each
// thread (4 channels, every 16th or 8th position) sums its positions, the lanes of a warp that
// share channels add theirs by shuffles, the warps theirs in shared memory in warp order, and the
// CTA writes one [kTaps + 1][C] partial (its chunk's columns) into the workspace.
template <typename T>
__global__ void __launch_bounds__(kThreads) backward_kernel(GridConvArgs a, Banding band) {
  extern __shared__ __align__(16) unsigned char smem[];
  constexpr int vec = 4, lanes = BandCta<T>::kChunk / vec;  // 16 (16-bit) or 8 (fp32)
  constexpr int chunk_elems = BandCta<T>::kChunk;
  const BandCta<T> cta(a, band, smem);
  const int tokens = a.grid_h * a.grid_w, width = band.width;
  const int64_t image = static_cast<int64_t>(cta.b) * tokens * a.channels;
  T* xs = cta.tile(smem, 0);
  T* ds = cta.tile(smem, 1);
  cta.stage(static_cast<const T*>(a.x) + cta.b * a.x_batch_stride, a.x_token_stride, xs);
  cta.stage(static_cast<const T*>(a.dout) + image, a.channels, ds);
  const int lane = threadIdx.x % lanes, c = cta.c0 + lane * vec;
  const bool live = lane * vec < cta.chunk;
  float w[kTaps][vec];
  load_weights<vec>(a.weight, c, live, w);
  float dw[kTaps][vec] = {}, db[vec] = {};
  async_copy::wait<0>();
  __syncthreads();
  if (live) {
    T* dx = static_cast<T*>(a.dx) + image + c;
    for (int p = threadIdx.x / lanes; p < cta.rows * a.grid_w; p += kThreads / lanes) {
      const int cell = cta.cell_of(p, a.grid_w);
      const int at = cell * chunk_elems + lane * vec;
      float g[vec], acc[vec] = {};
      load_pack<T, vec>(ds + at, g);
#pragma unroll
      for (int e = 0; e < vec; ++e) db[e] += g[e];
#pragma unroll
      for (int tap = 0; tap < kTaps; ++tap) {
        // out here read x at its neighbour `tap`; x here fed the output at the mirrored
        // neighbour with the weight of `tap` (outside the grid: a zero cell).
        const int offset = ((tap / K - 1) * width + tap % K - 1) * chunk_elems;
        float v[vec], h[vec];
        load_pack<T, vec>(xs + at + offset, v);
        load_pack<T, vec>(ds + at - offset, h);
#pragma unroll
        for (int e = 0; e < vec; ++e) {
          dw[tap][e] = fmaf(g[e], v[e], dw[tap][e]);
          acc[e] = fmaf(w[tap][e], h[e], acc[e]);
        }
      }
      store_pack<T, vec>(dx + static_cast<int64_t>(cta.table[cell]) * a.channels, acc);
    }
  }
  // Lanes of one warp with the same channels: lane, lane + lanes, ... (a fixed shuffle order).
#pragma unroll
  for (int offset = lanes; offset < 32; offset <<= 1) {
#pragma unroll
    for (int e = 0; e < vec; ++e) {
      db[e] += __shfl_xor_sync(0xffffffffu, db[e], offset);
#pragma unroll
      for (int tap = 0; tap < kTaps; ++tap)
        dw[tap][e] += __shfl_xor_sync(0xffffffffu, dw[tap][e], offset);
    }
  }
  __syncthreads();  // the tiles are done with: the warps' sums go over them
  float* sums = reinterpret_cast<float*>(cta.tile(smem, 0));  // [kWarps][kTaps + 1][chunk_elems]
  const int warp = threadIdx.x / 32;
  if (threadIdx.x % 32 < lanes) {
#pragma unroll
    for (int row = 0; row <= kTaps; ++row) {
#pragma unroll
      for (int e = 0; e < vec; ++e)
        sums[(warp * (kTaps + 1) + row) * chunk_elems + lane * vec + e] =
            row < kTaps ? dw[row][e] : db[e];
    }
  }
  __syncthreads();
  const int part = blockIdx.y * band.bands +
                   blockIdx.x / ((a.channels + chunk_elems - 1) / chunk_elems);  // image-major
  float* partial = a.workspace + static_cast<int64_t>(part) * (kTaps + 1) * a.channels + cta.c0;
  for (int e = threadIdx.x; e < (kTaps + 1) * cta.chunk; e += kThreads) {
    const int row = e / cta.chunk, col = e - row * cta.chunk;
    float total = 0.f;
#pragma unroll
    for (int from = 0; from < kWarps; ++from)
      total += sums[(from * (kTaps + 1) + row) * chunk_elems + col];
    partial[row * a.channels + col] = total;
  }
}

// Where the column sums of the [parts, (kTaps + 1) * C] partials go: row r < kTaps is tap r of
// dweight ([C, kTaps]), the last row dbias.
struct ConvGradients {
  float* dweight;
  float* dbias;
  int channels;
  __device__ void operator()(int e, float total) const {
    const int row = e / channels, c = e - row * channels;
    if (row < kTaps) {
      dweight[c * kTaps + row] = total;
    } else if (dbias != nullptr) {
      dbias[c] = total;
    }
  }
};

int chunks_of(const GridConvArgs& a) {
  const int elems = kChunkBytes / (a.dtype == DType::f32 ? 4 : 2);
  return (a.channels + elems - 1) / elems;
}

template <typename Kernel>
cudaError_t launch(Kernel kernel, const GridConvArgs& a, const Banding& band, cudaStream_t stream) {
  if (band.smem > 48 * 1024) {
    const cudaError_t err =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, band.smem);
    if (err != cudaSuccess) return err;
  }
  kernel<<<dim3(band.bands * chunks_of(a), a.batch), kThreads, band.smem, stream>>>(a, band);
  return cudaGetLastError();
}

}  // namespace

bool grid_conv_supported(const GridConvArgs& a) {
  const int vec = a.dtype == DType::f32 ? 4 : 8;  // 16 bytes; the backward's 4 divides it too
  if (a.batch <= 0 || a.channels <= 0 || a.channels % vec != 0) return false;
  if (a.grid_h <= 0 || a.grid_w <= 0 || a.tiles_h <= 0 || a.tiles_w <= 0) return false;
  if (a.grid_h % a.tiles_h != 0 || a.grid_w % a.tiles_w != 0) return false;
  if (a.grid_w > (1 << 20)) return false;  // the band's sizes stay in int
  const int64_t tokens = static_cast<int64_t>(a.grid_h) * a.grid_w;
  // The backward's two tiles of three rows must fit (grid_w up to 260).
  const Banding backward(a, 2);
  return backward.rows > 0 && a.batch <= 65535 && tokens * a.channels <= INT32_MAX &&
         static_cast<int64_t>(backward.bands) * chunks_of(a) <= INT32_MAX;
}

size_t grid_conv_workspace_floats(const GridConvArgs& a) {
  return static_cast<size_t>(a.batch) * Banding(a, 2).bands * (kTaps + 1) * a.channels;
}

cudaError_t grid_conv_forward(const GridConvArgs& a, cudaStream_t stream) {
  if (!grid_conv_supported(a) || a.x == nullptr || a.weight == nullptr || a.out == nullptr)
    return cudaErrorInvalidValue;
  const Banding band(a, 1);
  return with_element_type(a.dtype, [&](auto zero) {
    using T = decltype(zero);
    return launch(forward_kernel<T>, a, band, stream);
  });
}

cudaError_t grid_conv_backward(const GridConvArgs& a, cudaStream_t stream) {
  if (!grid_conv_supported(a) || a.x == nullptr || a.weight == nullptr || a.dout == nullptr ||
      a.dx == nullptr || a.dweight == nullptr || a.workspace == nullptr)
    return cudaErrorInvalidValue;
  const Banding band(a, 2);
  const cudaError_t err = with_element_type(a.dtype, [&](auto zero) {
    using T = decltype(zero);
    return launch(backward_kernel<T>, a, band, stream);
  });
  if (err != cudaSuccess) return err;
  return sum_partials(a.workspace, a.batch * band.bands, (kTaps + 1) * a.channels,
                      ConvGradients{a.dweight, a.dbias, a.channels}, stream);
}

}  // namespace mhla_kernels
