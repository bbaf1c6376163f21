// The dense-form short-sequence backward on warpgroup products: see
// resident_warpgroup_backward.h. One CTA per (batch, head), two warpgroups. Warpgroup w owns
// the key tiles w, w + 2 (first sweep: dv, dk, dm) and then the query tiles w, w + 2 (second
// sweep: dq); each sweep walks all 64-token tiles of the other side.
#include <climits>

#include "common/warpgroup_mma.cuh"
#include "mhla/resident_warpgroup_backward.h"
#include "mhla/tiles.cuh"

namespace mhla_kernels {
namespace {

namespace wg = warpgroup;
using tiles::kDenominatorEps;
using tiles::kFeatureFloor;
using tiles::kNormEps;

constexpr int kD = 64;
constexpr int kTile = 64;        // tokens per warpgroup product (its M, N or depth)
constexpr int kChunk = 16;       // tokens per k16 step; blocks are whole chunks
constexpr int kMaxTokens = 256;  // four tiles of each of q, k, v, g fill 128 KiB
constexpr int kThreads = 256;    // two warpgroups
constexpr int kAcc = kTile / 2;  // accumulator floats per thread of a 64 x 64 product

template <typename T>
using Tile = wg::CoreTile<T, kD>;

struct SmemPlan {
  size_t tile, vector, mix, dm_parts;
  __host__ __device__ SmemPlan(int n, int blocks)
      : tile(tiles::align128(static_cast<size_t>(n) * kD * 2)),
        vector(tiles::align128(static_cast<size_t>(n) * 4)),
        mix(tiles::align128(static_cast<size_t>(blocks) * blocks * 4)),
        dm_parts(tiles::align128(static_cast<size_t>(n / kChunk) * (n / kChunk) * 4)) {}
  __host__ __device__ size_t bytes() const { return 4 * tile + 3 * vector + mix + dm_parts; }
};

template <typename T>
__device__ __forceinline__ const T* row_of(const TokenTensor& t, int b, int token, int h) {
  return tiles::token_row<T, kD>(t, b, token, h);
}

// Starts the copies of the n token rows of one (batch, head) into a core tile.
template <typename T>
__device__ __forceinline__ void copy_tile_async(Tile<T> tile, const TokenTensor& src, int b, int h,
                                                int n) {
  for (int row0 = 0; row0 < n; row0 += kTile) {
    wg::copy_rows_async<T, kTile, kD, kThreads>(Tile<T>{tile.p + row0 * kD},
                                                row_of<T>(src, b, row0, h),
                                                static_cast<int>(src.token_stride), kTile);
  }
}

// One thread per row: the row's eight 16-byte pieces (a warp reads 32 rows, four wavefronts).
template <typename T>
__device__ __forceinline__ void read_row(Tile<T> tile, int r, float (&x)[kD]) {
#pragma unroll
  for (int c = 0; c < kD / 8; ++c) {
    const uint4 piece = *reinterpret_cast<const uint4*>(tile.at(r, 8 * c));
    const unsigned* words = reinterpret_cast<const unsigned*>(&piece);
#pragma unroll
    for (int i = 0; i < 4; ++i) unpack_pair<T>(words[i], x[8 * c + 2 * i], x[8 * c + 2 * i + 1]);
  }
}
template <typename T>
__device__ __forceinline__ void write_row(Tile<T> tile, int r, const float (&x)[kD]) {
#pragma unroll
  for (int c = 0; c < kD / 8; ++c) {
    uint4 piece;
    unsigned* words = reinterpret_cast<unsigned*>(&piece);
#pragma unroll
    for (int i = 0; i < 4; ++i) words[i] = pack_pair<T>(x[8 * c + 2 * i], x[8 * c + 2 * i + 1]);
    *reinterpret_cast<uint4*>(tile.at(r, 8 * c)) = piece;
  }
}

// phi(x) = relu(x / rms(x)) + floor of row r in place; returns 1 / rms.
template <typename T>
__device__ __forceinline__ float features_of_row(Tile<T> tile, int r) {
  float x[kD];
  read_row(tile, r, x);
  float squares = 0.f;
#pragma unroll
  for (int i = 0; i < kD; ++i) squares += x[i] * x[i];
  const float scale = rsqrtf(squares / kD + kNormEps);
#pragma unroll
  for (int i = 0; i < kD; ++i) x[i] = fmaxf(x[i] * scale, 0.f) + kFeatureFloor;
  write_row(tile, r, x);
  return scale;
}

// Row r of gs holds do; afterwards g = do / (den + eps). Returns gd = -(do . o) / (den + eps).
template <typename T>
__device__ __forceinline__ float scale_gradient_row(Tile<T> gs, int r, const uint4 (&o)[kD / 8],
                                                    float den) {
  float x[kD];
  read_row(gs, r, x);
  const float scale = 1.f / (den + kDenominatorEps);
  float dot = 0.f;
#pragma unroll
  for (int c = 0; c < kD / 8; ++c) {
    const unsigned* words = reinterpret_cast<const unsigned*>(&o[c]);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float o0, o1;
      unpack_pair<T>(words[i], o0, o1);
      dot += x[8 * c + 2 * i] * o0 + x[8 * c + 2 * i + 1] * o1;
    }
  }
#pragma unroll
  for (int i = 0; i < kD; ++i) x[i] *= scale;
  write_row(gs, r, x);
  return -dot * scale;
}

// Keeps the register operands of an asynchronous product alive (and unchanged) until its wait.
__device__ __forceinline__ void pin_fragments(unsigned (&a)[kTile / 16][4]) {
#pragma unroll
  for (int kb = 0; kb < kTile / 16; ++kb)
#pragma unroll
    for (int i = 0; i < 4; ++i) asm volatile("" : "+r"(a[kb][i])::"memory");
}

// Where a thread's accumulator rows go: row0 = first row of the warp's strip + lane / 4, and
// row0 + 8; element i of n8 tile j is column 8 j + 2 (lane % 4) + i % 2, row row0 + 8 (i % 4 >= 2).
struct Rows {
  int b, h, heads, n;
  __device__ size_t index(int token) const {
    return (static_cast<size_t>(b) * n + token) * heads + h;
  }
};

template <typename T>
__device__ __forceinline__ void store_rows(T* dst, const Rows& rows, int row0,
                                           const float (&acc)[kAcc]) {
  const int c0 = 2 * (threadIdx.x % 4);
  T* lo = dst + rows.index(row0) * kD + c0;
  T* hi = dst + rows.index(row0 + 8) * kD + c0;
#pragma unroll
  for (int j = 0; j < kAcc / 4; ++j) {
    *reinterpret_cast<unsigned*>(lo + 8 * j) = pack_pair<T>(acc[4 * j], acc[4 * j + 1]);
    *reinterpret_cast<unsigned*>(hi + 8 * j) = pack_pair<T>(acc[4 * j + 2], acc[4 * j + 3]);
  }
}

// dx = s (relu'(y) dphi - y (y . relu'(y) dphi) / D) with y = x s, s = 1 / rms(x), for the two
// rows of a thread (the four lanes of a quad hold a row between them); then stored.
template <typename T>
__device__ __forceinline__ void store_feature_gradient(T* dst, const Rows& rows, int row0,
                                                       const TokenTensor& raw, const float* inv_rms,
                                                       float (&acc)[kAcc]) {
  const int c0 = 2 * (threadIdx.x % 4);
  const T* lo = row_of<T>(raw, rows.b, row0, rows.h) + c0;
  const T* hi = row_of<T>(raw, rows.b, row0 + 8, rows.h) + c0;
  const float s_lo = inv_rms[row0], s_hi = inv_rms[row0 + 8];
  float x[kAcc];
#pragma unroll
  for (int j = 0; j < kAcc / 4; ++j) {
    unpack_pair<T>(*reinterpret_cast<const unsigned*>(lo + 8 * j), x[4 * j], x[4 * j + 1]);
    unpack_pair<T>(*reinterpret_cast<const unsigned*>(hi + 8 * j), x[4 * j + 2], x[4 * j + 3]);
  }
  float dot_lo = 0.f, dot_hi = 0.f;
#pragma unroll
  for (int i = 0; i < kAcc; ++i) {
    const bool high = (i % 4) >= 2;
    const float y = x[i] * (high ? s_hi : s_lo);
    acc[i] = y > 0.f ? acc[i] : 0.f;
    (high ? dot_hi : dot_lo) += acc[i] * y;
  }
#pragma unroll
  for (int offset = 1; offset < 4; offset *= 2) {
    dot_lo += __shfl_xor_sync(0xffffffffu, dot_lo, offset);
    dot_hi += __shfl_xor_sync(0xffffffffu, dot_hi, offset);
  }
  dot_lo /= kD, dot_hi /= kD;
#pragma unroll
  for (int i = 0; i < kAcc; ++i) {
    const bool high = (i % 4) >= 2;
    const float s = high ? s_hi : s_lo;
    acc[i] = s * (acc[i] - x[i] * s * (high ? dot_hi : dot_lo));
  }
  store_rows(dst, rows, row0, acc);
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

template <typename T>
__global__ void __launch_bounds__(kThreads, 1)
    resident_warpgroup_backward_kernel(ResidentBlockLinearBackward p) {
  extern __shared__ __align__(128) unsigned char smem[];
  const auto& s = p.shape;
  const int n = s.tokens, tile_count = n / kTile, chunks = n / kChunk;
  const int bh = blockIdx.x, b = bh / s.heads, h = bh % s.heads;
  const bool mixes = p.mixing != nullptr;
  const int blocks = mixes ? s.blocks : 1;
  const int block_chunks = chunks / blocks;  // 16-token chunks per block
  const SmemPlan plan(n, blocks);
  tiles::Carver carve{smem};
  const Tile<T> qf{carve.take<T>(plan.tile)}, kf{carve.take<T>(plan.tile)},
      vs{carve.take<T>(plan.tile)}, gs{carve.take<T>(plan.tile)};
  float* inv_rms_q = carve.take<float>(plan.vector);
  float* inv_rms_k = carve.take<float>(plan.vector);
  float* gd = carve.take<float>(plan.vector);
  float* mix = carve.take<float>(plan.mix);
  float* dm_parts = carve.take<float>(plan.dm_parts);  // [key chunk][query chunk]

  // Tiles in flight while each thread fetches its row of the forward's output and row sum.
  copy_tile_async(qf, p.q, b, h, n);
  copy_tile_async(kf, p.k, b, h, n);
  copy_tile_async(vs, p.v, b, h, n);
  copy_tile_async(gs, p.grad_out, b, h, n);
  const int row = threadIdx.x;
  uint4 o[kD / 8];
  float den = 0.f;
  if (row < n) {
    den = p.den[static_cast<size_t>(bh) * n + row];
    const uint4* from = reinterpret_cast<const uint4*>(row_of<T>(p.out, b, row, h));
#pragma unroll
    for (int c = 0; c < kD / 8; ++c) o[c] = __ldg(from + c);
  }
  if (mixes) {
    for (int e = threadIdx.x; e < blocks * blocks; e += kThreads) mix[e] = p.mixing[e];
  }
  asm volatile("cp.async.wait_all;\n" ::: "memory");
  __syncthreads();
  if (row < n) {
    inv_rms_q[row] = features_of_row(qf, row);
    inv_rms_k[row] = features_of_row(kf, row);
    gd[row] = scale_gradient_row(gs, row, o, den);
  }
  wg::fence_shared_for_mma();
  __syncthreads();

  const int group = threadIdx.x / 128, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  const int c0 = 2 * (lane % 4);
  const Rows rows{b, h, s.heads, n};

  // Keys: dv, dk and dm's parts.
  for (int kt = group; kt < tile_count; kt += 2) {
    const int key0 = kt * kTile;
    const int key_chunk = kt * (kTile / kChunk) + warp;  // this warp's 16 keys
    const int key_block = key_chunk / block_chunks;
    float dv[kAcc], dk[kAcc];
#pragma unroll
    for (int i = 0; i < kAcc; ++i) dv[i] = dk[i] = 0.f;
    for (int qt = 0; qt < tile_count; ++qt) {
      const int query0 = qt * kTile;
      float scores[kAcc], dp[kAcc];
      wg::fence();
      wg::product<T, kTile, kD>(scores, kf, key0, 0, qf, query0, 0, false);
      wg::product<T, kTile, kD>(dp, vs, key0, 0, gs, query0, 0, false);
      wg::wait<0>();
      unsigned pa[kTile / 16][4], da[kTile / 16][4];
#pragma unroll
      for (int jj = 0; jj < kTile / 16; ++jj) {
        const int query_chunk = qt * (kTile / kChunk) + jj;
        const float w = mixes ? mix[(query_chunk / block_chunks) * blocks + key_block] : 1.f;
        const float2 g0 = *reinterpret_cast<const float2*>(gd + query0 + 16 * jj + c0);
        const float2 g1 = *reinterpret_cast<const float2*>(gd + query0 + 16 * jj + 8 + c0);
        float* a = scores + 8 * jj;
        float* d = dp + 8 * jj;
        d[0] += g0.x, d[1] += g0.y, d[2] += g0.x, d[3] += g0.y;
        d[4] += g1.x, d[5] += g1.y, d[6] += g1.x, d[7] += g1.y;
        if (mixes) {
          float part = 0.f;
#pragma unroll
          for (int e = 0; e < 8; ++e) part += a[e] * d[e];
          part = warp_sum(part);
          if (lane == 0) dm_parts[key_chunk * chunks + query_chunk] = part;
        }
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          pa[jj][r] = pack_pair<T>(a[2 * r] * w, a[2 * r + 1] * w);
          da[jj][r] = pack_pair<T>(d[2 * r] * w, d[2 * r + 1] * w);
        }
      }
      wg::fence();
      wg::product_register_a<T, kD, kTile>(dv, pa, gs, query0, 0, true);
      wg::product_register_a<T, kD, kTile>(dk, da, qf, query0, 0, true);
      wg::wait<0>();
      pin_fragments(pa);
      pin_fragments(da);
    }
    const int row0 = key0 + 16 * warp + lane / 4;
    store_rows(static_cast<T*>(p.grad_v), rows, row0, dv);
    store_feature_gradient(static_cast<T*>(p.grad_k), rows, row0, p.k, inv_rms_k, dk);
  }

  // Queries: dq, recomputing dP with the queries as rows.
  for (int qt = group; qt < tile_count; qt += 2) {
    const int query0 = qt * kTile;
    const int query_block = (qt * (kTile / kChunk) + warp) / block_chunks;
    const int row0 = query0 + 16 * warp + lane / 4;
    const float gd_lo = gd[row0], gd_hi = gd[row0 + 8];
    float dq[kAcc];
#pragma unroll
    for (int i = 0; i < kAcc; ++i) dq[i] = 0.f;
    for (int kt = 0; kt < tile_count; ++kt) {
      const int key0 = kt * kTile;
      float dp[kAcc];
      wg::fence();
      wg::product<T, kTile, kD>(dp, gs, query0, 0, vs, key0, 0, false);
      wg::wait<0>();
      unsigned da[kTile / 16][4];
#pragma unroll
      for (int jj = 0; jj < kTile / 16; ++jj) {
        const int key_chunk = kt * (kTile / kChunk) + jj;
        const float w = mixes ? mix[query_block * blocks + key_chunk / block_chunks] : 1.f;
        const float* d = dp + 8 * jj;
        da[jj][0] = pack_pair<T>((d[0] + gd_lo) * w, (d[1] + gd_lo) * w);
        da[jj][1] = pack_pair<T>((d[2] + gd_hi) * w, (d[3] + gd_hi) * w);
        da[jj][2] = pack_pair<T>((d[4] + gd_lo) * w, (d[5] + gd_lo) * w);
        da[jj][3] = pack_pair<T>((d[6] + gd_hi) * w, (d[7] + gd_hi) * w);
      }
      wg::fence();
      wg::product_register_a<T, kD, kTile>(dq, da, kf, key0, 0, true);
      wg::wait<0>();
      pin_fragments(da);
    }
    store_feature_gradient(static_cast<T*>(p.grad_q), rows, row0, p.q, inv_rms_q, dq);
  }

  if (mixes) {
    __syncthreads();
    for (int e = threadIdx.x; e < blocks * blocks; e += kThreads) {
      const int query_block = e / blocks, key_block = e % blocks;
      float total = 0.f;
      for (int kc = key_block * block_chunks; kc < (key_block + 1) * block_chunks; ++kc)
        for (int qc = query_block * block_chunks; qc < (query_block + 1) * block_chunks; ++qc)
          total += dm_parts[kc * chunks + qc];
      if (p.grad_mixing_parts != nullptr) {
        p.grad_mixing_parts[static_cast<size_t>(bh) * blocks * blocks + e] = total;
      } else if (total != 0.f) {
        atomicAdd(p.grad_mixing + e, total);
      }
    }
  }
}

template <typename T>
cudaError_t launch(const ResidentBlockLinearBackward& a, cudaStream_t stream) {
  const auto& s = a.shape;
  const int blocks = a.mixing != nullptr ? s.blocks : 1;
  cudaError_t err = cudaSuccess;
  if (a.mixing != nullptr && a.grad_mixing_parts == nullptr &&
      (err = cudaMemsetAsync(a.grad_mixing, 0, sizeof(float) * blocks * blocks, stream)) !=
          cudaSuccess)
    return err;
  const size_t bytes = SmemPlan(s.tokens, blocks).bytes();
  if ((err = tiles::allow_smem(resident_warpgroup_backward_kernel<T>, bytes)) != cudaSuccess)
    return err;
  resident_warpgroup_backward_kernel<T><<<s.batch * s.heads, kThreads, bytes, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace

bool resident_warpgroup_backward_supported(const BlockLinearShape& s, DType dtype) {
  if (dtype != DType::bf16 && dtype != DType::f16) return false;
  if (s.head_dim != kD || s.tokens <= 0 || s.tokens > kMaxTokens || s.tokens % kTile != 0)
    return false;
  if (s.batch <= 0 || s.heads <= 0 || static_cast<int64_t>(s.batch) * s.heads > INT_MAX)
    return false;
  if (s.blocks < 1 || s.tokens % s.blocks != 0 || (s.tokens / s.blocks) % kChunk != 0) return false;
  return true;
}

cudaError_t resident_warpgroup_backward(const ResidentBlockLinearBackward& args,
                                        cudaStream_t stream) {
  if (!resident_warpgroup_backward_supported(args.shape, args.dtype) || args.den == nullptr ||
      (args.mixing == nullptr && args.shape.blocks != 1) ||
      (args.mixing != nullptr && args.grad_mixing == nullptr))
    return cudaErrorInvalidValue;
  return args.dtype == DType::bf16 ? launch<__nv_bfloat16>(args, stream)
                                   : launch<__half>(args, stream);
}

}  // namespace mhla_kernels
