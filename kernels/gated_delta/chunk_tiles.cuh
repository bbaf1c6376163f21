#pragma once
// Shared-memory helpers of the fused gated-delta passes (kernels/gated_delta/chunk_*.cu): the
// position of a chunk, asynchronous 16-byte loads (token-major rows or contiguous per-chunk
// tiles), 16-byte stores of fp32 rows, running gate sums, the decayed causal product tile,
// reductions, the dtype x head-dim dispatch and the launcher.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "common/element_type.cuh"
#include "common/packed_access.cuh"
#include "common/wmma_gemm.cuh"
#include "gated_delta/chunk_fused.h"

namespace mhla_kernels {
namespace gated_delta {

using wmma_tiles::Mma;

// The CTA-wide product (kernels/common/wmma_gemm.cuh), warps taking blocks of output tiles.
// MinBlocks < Warps: bigger tile blocks on fewer warps, for passes bound by shared-memory
// throughput (ncu) whose registers allow it (chunk_grads 850 -> 794 us at T = 2,048 with Warps / 2;
// the prepare pass would lose its second CTA per SM to the registers).
template <typename T, int Warps, bool TransA, bool TransB, int MinBlocks = Warps>
__device__ __forceinline__ void gemm(const typename Mma<T>::elem* a, int lda,
                                     const typename Mma<T>::elem* b, int ldb, float* c, int ldc,
                                     int m, int n, int k, bool accumulate) {
  wmma_tiles::gemm_blocked<T, Warps, TransA, TransB, MinBlocks>(a, lda, b, ldb, c, ldc, m, n, k,
                                                                accumulate);
}

constexpr int kC = kGatedDeltaChunk;
constexpr int kLdSquare = kC + 4;   // fp32 64 x 64 tiles
constexpr int kLdSquareE = kC + 8;  // element-type 64 x 64 tiles

// fp32 rows padded by 8 floats: the tensor-core accumulators are stored and reloaded as column
// pairs (8 bytes) by rows of 4 lanes, and a row stride of 8 banks (mod 32) keeps a half-warp's
// four rows on distinct banks (a padding of 4 made them 2-way conflicts: ncu counted a quarter
// of the chunk-gradient pass's shared-memory wavefronts as excessive).
template <int D>
struct Ld {
  static constexpr int e = D + 8;  // element-type rows of D
  static constexpr int f = D + 8;  // fp32 rows of D
};

// Where one CTA's chunk lies: batch, head, chunk index and its valid rows.
struct ChunkPosition {
  int b, h, bh, chunk, chunks, t0, valid;
  __device__ ChunkPosition(const GatedDeltaArgs& p, int bh_index, int chunk_index)
      : ChunkPosition(p, bh_index, bh_index / p.heads, bh_index % p.heads, chunk_index) {}
  // With the batch and head of bh_index known (the state walks: no division every chunk).
  __device__ ChunkPosition(const GatedDeltaArgs& p, int bh_index, int b_index, int h_index,
                           int chunk_index) {
    bh = bh_index;
    b = b_index;
    h = h_index;
    chunk = chunk_index;
    chunks = gated_delta_chunks(p.tokens);
    t0 = chunk * kC;
    valid = min(kC, p.tokens - t0);
  }
  // Offset of token row r (of this chunk) in a token-major [B, T, H, width] tensor.
  __device__ int64_t token(int r, int width, int heads, int tokens) const {
    return ((static_cast<int64_t>(b) * tokens + t0 + r) * heads + h) * width;
  }
  // Offset of row r in a per-chunk [BH, chunks, 64, width] buffer.
  __device__ int64_t tile(int r, int width) const {
    return ((static_cast<int64_t>(bh) * chunks + chunk) * kC + r) * width;
  }
  // Offset of this chunk's [D, D] state.
  __device__ int64_t state(int d) const {
    return (static_cast<int64_t>(bh) * chunks + chunk) * d * d;
  }
};

// The reverse: a [Rows][Cols] shared-memory element-type matrix out to global.
template <typename T, int Rows, int Cols, int Threads>
__device__ void store_matrix(T* dst, int width, const T* src, int ld) {
  constexpr int kPerRow = Cols / 8;
  for (int e = threadIdx.x; e < Rows * kPerRow; e += Threads) {
    const int r = e / kPerRow, c = (e % kPerRow) * 8;
    *reinterpret_cast<uint4*>(dst + static_cast<int64_t>(r) * width + c) =
        *reinterpret_cast<const uint4*>(src + r * ld + c);
  }
}

// Element-type copy of a fp32 [Rows][Cols] shared tile (scaled), in shared memory.
template <typename T, int Rows, int Cols, int Threads>
__device__ void convert_tile(T* dst, int ld_dst, const float* src, int ld_src, float scale = 1.f) {
  for (int e = threadIdx.x; e < Rows * Cols; e += Threads) {
    const int r = e / Cols, c = e % Cols;
    dst[r * ld_dst + c] = from_float<T>(scale * src[r * ld_src + c]);
  }
}

// Asynchronous 16-byte copy global -> shared (cp.async, L2 only); zero-filled when !valid.
__device__ __forceinline__ void copy_async16(void* dst, const void* src, bool valid) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(src),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void copy_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::);
}
template <int Pending>
__device__ __forceinline__ void copy_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(Pending));
}

// dst[r][c] = src[r * stride + c] for the chunk's 64 rows and c < Cols (rows >= valid zero),
// asynchronously, the rows' addresses as one base and a 32-bit stride (the state walks issue
// their copies every chunk: with an offset computed per row in 64 bits, the copies took about a
// third of their stall samples at T = 32,768).
template <typename T, int Cols, int Threads>
__device__ __forceinline__ void copy_strided_rows_async(T* dst, int ld, const T* src, int stride,
                                                        int valid) {
  constexpr int kVec = 16 / static_cast<int>(sizeof(T));
  constexpr int kPerRow = Cols / kVec;
  constexpr int kCopies = kC * kPerRow;
#pragma unroll
  for (int j = 0; j < (kCopies + Threads - 1) / Threads; ++j) {
    const int e = static_cast<int>(threadIdx.x) + j * Threads;
    if (kCopies % Threads == 0 || e < kCopies) {
      const int r = e / kPerRow, c = (e % kPerRow) * kVec;
      const bool in = r < valid;
      copy_async16(dst + r * ld + c, src + (in ? r * stride : 0) + c, in);
    }
  }
}

// The loads every pass starts with, all asynchronous (cp.async: no register round trip, so a
// thread's copies are all in flight at once); finish_loads() waits for them, before the
// __syncthreads that publishes them.
// The chunk's rows of a token-major [B, T, H, Cols] input (rows past the sequence zero).
template <typename T, int Cols, int Threads>
__device__ void load_token_rows(T* dst, int ld, const void* base, const GatedDeltaArgs& p,
                                const ChunkPosition& at) {
  copy_strided_rows_async<T, Cols, Threads>(
      dst, ld, static_cast<const T*>(base) + at.token(0, Cols, p.heads, p.tokens), p.heads * Cols,
      at.valid);
}

// A [Rows][Cols] matrix from global (row stride width) into shared memory (row stride ld).
template <typename T, int Rows, int Cols, int Threads>
__device__ void load_matrix(T* dst, int ld, const T* src, int width) {
  constexpr int kVec = 16 / static_cast<int>(sizeof(T));
  constexpr int kPerRow = Cols / kVec;
  for (int e = threadIdx.x; e < Rows * kPerRow; e += Threads) {
    const int r = e / kPerRow, c = (e % kPerRow) * kVec;
    copy_async16(dst + r * ld + c, src + static_cast<int64_t>(r) * width + c, true);
  }
}

__device__ __forceinline__ void finish_loads() {
  copy_async_commit();
  copy_async_wait<0>();
}

// dst_row(r)[c] = scale * src[r][c] (fp32 shared, row stride ld: a multiple of 4) for r < rows,
// c < Cols, in 16-byte loads and stores.
template <typename T, int Cols, int Threads, typename RowPtr>
__device__ void store_rows(RowPtr dst_row, const float* src, int ld, int rows, float scale = 1.f) {
  for (int e = threadIdx.x; e < rows * (Cols / 8); e += Threads) {
    const int r = e / (Cols / 8), c = (e % (Cols / 8)) * 8;
    alignas(16) float x[8];
    *reinterpret_cast<float4*>(x) = *reinterpret_cast<const float4*>(src + r * ld + c);
    *reinterpret_cast<float4*>(x + 4) = *reinterpret_cast<const float4*>(src + r * ld + c + 4);
#pragma unroll
    for (int j = 0; j < 8; ++j) x[j] *= scale;
    store_pack<T, 8>(dst_row(r) + c, x);
  }
}

// In-place running sums down the Cols columns of a [64][ld] fp32 tile (KDA's gate sums G, and
// with Reverse the sums from the bottom up of their gradient): eight segments of eight rows per
// column, each summed by its own thread, then offset by the segments before it (three short
// dependent chains instead of one of 64 shared-memory round trips). Ends before a barrier.
template <int Cols, int Threads, bool Reverse = false>
__device__ void running_sums_down_columns(float* x, int ld, float* segment_sums /* [8][Cols] */) {
  constexpr int kSegments = 8, kRows = kC / kSegments;
  auto row = [](int seg, int r) { return Reverse ? kC - 1 - (seg * kRows + r) : seg * kRows + r; };
  for (int e = threadIdx.x; e < kSegments * Cols; e += Threads) {
    const int seg = e / Cols, c = e % Cols;
    float sum = 0.f;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      float& v = x[row(seg, r) * ld + c];
      sum += v;
      v = sum;
    }
    segment_sums[seg * Cols + c] = sum;
  }
  __syncthreads();
  for (int e = threadIdx.x; e < kSegments * Cols; e += Threads) {
    const int seg = e / Cols, c = e % Cols;
    float before = 0.f;
    for (int k = 0; k < seg; ++k) before += segment_sums[k * Cols + c];
#pragma unroll
    for (int r = 0; r < kRows; ++r) x[row(seg, r) * ld + c] += before;
  }
}

// In-place inclusive running sum of 64 values, by one warp.
__device__ __forceinline__ void warp_running_sum64(float* x) {
  const int lane = threadIdx.x % 32;
  const float a = x[2 * lane], b = x[2 * lane + 1];
  float pair = a + b, sum = pair;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const float up = __shfl_up_sync(0xffffffffu, sum, o);
    if (lane >= o) sum += up;
  }
  const float before = sum - pair;
  x[2 * lane] = before + a;
  x[2 * lane + 1] = before + a + b;
}

// In-place reverse running sum (x[r] = sum over s >= r), by one warp.
__device__ __forceinline__ void warp_reverse_running_sum64(float* x) {
  const int lane = threadIdx.x % 32;
  const float a = x[62 - 2 * lane], b = x[63 - 2 * lane];  // lane 0 takes the last pair
  float pair = a + b, sum = pair;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const float up = __shfl_up_sync(0xffffffffu, sum, o);
    if (lane >= o) sum += up;
  }
  const float after = sum - pair;
  x[63 - 2 * lane] = after + b;
  x[62 - 2 * lane] = after + a + b;
}

// The chunk's gate sums G (fp32, from the prepare pass) into shared memory.
__device__ __forceinline__ void load_gate_sums(float* g, const GatedDeltaArgs& p,
                                               const ChunkPosition& at) {
  if (threadIdx.x < kC) {
    g[threadIdx.x] =
        p.gate_sums[(static_cast<int64_t>(at.bh) * at.chunks + at.chunk) * kC + threadIdx.x];
  }
}

// The chunk's causal decays: out[r][s] = in[r][s] * exp(G_r - G_s) for s <= r, else 0, as the
// element type (in: fp32 [64][68], out [64][72]); exp(G_r - G_s) <= 1, so no overflow.
template <typename T, int Threads>
__device__ void causal_decayed(T* out, const float* in, const float* g) {
  for (int e = threadIdx.x; e < kC * kC / 8; e += Threads) {  // 16-byte stores
    const int r = e / (kC / 8), s0 = 8 * (e % (kC / 8));
    const float gr = g[r];
    float x[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      x[j] = s0 + j <= r ? in[r * kLdSquare + s0 + j] * __expf(gr - g[s0 + j]) : 0.f;
    }
    store_pack<T, 8>(out + r * kLdSquareE + s0, x);
  }
}

// Sum of x over the CTA; the result is valid in thread 0. `scratch` holds one float per warp.
template <int Threads>
__device__ float block_sum(float x, float* scratch) {
  x = warp_sum(x);
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = x;
  __syncthreads();
  float total = 0.f;
  if (threadIdx.x == 0) {
    for (int w = 0; w < Threads / 32; ++w) total += scratch[w];
  }
  return total;
}

// Dispatch over the element type and the head dim for a launcher templated on both.
template <template <typename, int> class Pass>
cudaError_t dispatch(const GatedDeltaArgs& a, cudaStream_t stream) {
  auto by_dim = [&](auto element) -> cudaError_t {
    using T = decltype(element);
    if (a.head_dim == 64) return Pass<T, 64>::launch(a, stream);
    if (a.head_dim == 128) return Pass<T, 128>::launch(a, stream);
    return cudaErrorInvalidValue;
  };
  switch (a.dtype) {
    case DType::bf16:
      return by_dim(__nv_bfloat16{});
    case DType::f16:
      return by_dim(__half{});
    default:
      return cudaErrorInvalidValue;
  }
}

// The grid of the per-chunk passes: (chunks, B * H, parts).
// The chunks a pass covers (GatedDeltaArgs::chunk_begin, chunk_end).
MHLA_GATED_DELTA_HD inline int range_end(const GatedDeltaArgs& a) {
  return a.chunk_end > 0 ? a.chunk_end : gated_delta_chunks(a.tokens);
}

// One CTA per (chunk of the range, batch x head, part).
inline dim3 chunk_grid(const GatedDeltaArgs& a, int parts = 1) {
  return dim3(range_end(a) - a.chunk_begin, a.batch * a.heads, parts);
}

// The chunk of a per-chunk pass's CTA (grid from chunk_grid).
__device__ inline ChunkPosition block_chunk(const GatedDeltaArgs& p) {
  return ChunkPosition(p, blockIdx.y, p.chunk_begin + blockIdx.x);
}

// Opts the kernel into `bytes` of dynamic shared memory and launches it.
template <typename Kernel>
cudaError_t launch_pass(Kernel kernel, dim3 grid, int threads, size_t bytes,
                        const GatedDeltaArgs& a, cudaStream_t stream) {
  if (cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             static_cast<int>(bytes));
      err != cudaSuccess) {
    return err;
  }
  kernel<<<grid, threads, bytes, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace gated_delta
}  // namespace mhla_kernels
