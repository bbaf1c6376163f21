// MHLA's short-sequence backward in state form: see resident_state_backward.h. One CTA of 16 warps
// per (batch, head). After the tiles are prepared (phi(q), phi(k), v, g in shared memory; z and
// z' on CUDA cores), each 16-column value slice runs three phases between barriers:
//   A. the slice of every block state S_j and query-side gradient dS'_i (one block's 64 x 16
//      slice per warp task; depth: the block's tokens);
//   B. the mixing: S' = m S and dS = m^T dS' over the 16 blocks (one k16 step each, m split into
//      a bf16 high and low part so the weights keep fp32 precision), and dm += dS' S^T; each warp
//      owns 16-element column tiles and writes S' and dS over S and dS' in place;
//   C. per 16-token strip (warp w owns strip w for the whole kernel): dphi(q) += g S'^T and
//      dphi(k) += v dS^T in registers, and the slice of dv = phi(k) dS straight out.
// After the slices each warp turns its dphi(q) rows into gd (no read of o), and the query-side
// z terms (dz', dz and dm's z part) follow on CUDA cores before the rank-one terms and dq, dk.
// A slice set holds one 16-column slice of the M states as a [16 blocks][64 x 16 + 8] matrix:
// the row padding makes its block rows 16 bytes apart modulo 128 (conflict-free ldmatrix across
// blocks), and the two 8-column halves of feature rows 4-7 modulo 8 are swapped, so the
// feature-wise ldmatrix reads of phases A and C do not collide either.
#include <cstdint>

#include "common/wmma_gemm.cuh"
#include "mhla/resident_state_backward.h"
#include "mhla/resident_tiles.cuh"

namespace mhla_kernels {
namespace {

using namespace resident_tiles;
using wmma_tiles::TileAccumulator;
namespace frag = wmma_tiles::detail;

constexpr int kD = 64;
constexpr int kSlice = 16;                       // value columns per slice
constexpr int kSlices = kD / kSlice;             // 4
constexpr int kSetBlocks = 16;                   // rows of a slice set: the mixing depth, k16
constexpr int kSetLd = kD * kSlice + 8;          // elements per block row of a slice set
constexpr int kMixLd = 24;                       // elements per row of the 16 x 16 weight tiles
constexpr int kStrips = kBackwardWarps;          // warps, one per 16-token strip: N <= 256
constexpr int kTileLd = ResidentLayout<kD>::ld;  // token tiles' row stride (elements)
// A warp's passes over its 16-token strip with one row per 8 lanes (dq and dk out).
constexpr int kStripPasses = kStrip * Layout<__nv_bfloat16, kD>::lanes / 32;

// Where feature row f's 8-column half `half` of one block's slice lies in a slice set row.
__device__ __forceinline__ int state_offset(int f, int half) {
  return f * kSlice + ((half ^ (f >> 2)) & 1) * 8;
}

// Byte offsets of the shared-memory regions for `padded` token rows. vs and gs are consecutive:
// after the slices they hold the warps' fp32 staging strips (exactly their size), and the sets
// the warps' parts of dm.
struct StateBackwardLayout {
  size_t qf, kf, vs, gs, sets, gd, rms_q, rms_k, w_hi, w_lo, w, z_mixed, dz, dw, total;
  __host__ __device__ explicit StateBackwardLayout(int padded) {
    size_t at = 0;
    auto take = [&at](size_t bytes) {
      const size_t here = at;
      at += align128(bytes);
      return here;
    };
    const size_t tile = ResidentLayout<kD>::tile_bytes(padded);
    qf = take(tile), kf = take(tile), vs = take(tile), gs = take(tile);
    sets = take(2 * static_cast<size_t>(kSetBlocks) * kSetLd * 2);
    gd = take(padded * 4), rms_q = take(padded * 4), rms_k = take(padded * 4);
    w_hi = take(kSetBlocks * kMixLd * 2), w_lo = take(kSetBlocks * kMixLd * 2);
    w = take(kSetBlocks * kSetBlocks * 4);
    z_mixed = take(kSetBlocks * kD * 4), dz = take(kSetBlocks * kD * 4);
    dw = take(kSetBlocks * kSetBlocks * 4);
    total = at;
  }
};

template <typename T>
__device__ __forceinline__ void store_pair(T* at, float lo, float hi) {
  *reinterpret_cast<uint32_t*>(at) = pack<T>(lo, hi);
}

// A 16 x 16 accumulator tile to shared memory as 16-bit values with one stmatrix: matrix m (of
// four 8 x 8) holds rows 8 (m % 2) .. + 7 and columns 8 (m / 2) .. + 7, and lane l hands in the
// address of row l % 8 of matrix l / 8. The accumulator layout is stmatrix's fragment layout.
template <typename T>
__device__ __forceinline__ void store_tile_matrices(const TileAccumulator& acc, unsigned address) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(address),
               "r"(pack<T>(acc.x[0][0], acc.x[0][1])), "r"(pack<T>(acc.x[0][2], acc.x[0][3])),
               "r"(pack<T>(acc.x[1][0], acc.x[1][1])), "r"(pack<T>(acc.x[1][2], acc.x[1][3]))
               : "memory");
}

// One 16 x 16 output tile whose rows are features f0 .. f0 + 15 (f0 a multiple of 16) and columns
// a block's 16 slice columns, into that block's row of a slice set (swizzled halves: this lane's
// row f = f0 + lane % 8 + 8 ((lane / 8) % 2) has swizzle bit (f >> 2) & 1 = (lane >> 2) & 1).
template <typename T>
__device__ __forceinline__ void store_state_tile(const TileAccumulator& acc, T* block_row, int f0) {
  const int lane = threadIdx.x % 32, matrix = lane / 8;
  const int f = f0 + lane % 8 + 8 * (matrix % 2), half = matrix / 2;
  store_tile_matrices<T>(acc, shared_address(block_row + state_offset(f, half)));
}

// A 16 x 16 tile of a slice set (all 16 block rows, physical columns col0 ..) in place.
template <typename T>
__device__ __forceinline__ void store_set_tile(const TileAccumulator& acc, T* set, int col0) {
  const int lane = threadIdx.x % 32, matrix = lane / 8;
  const int row = lane % 8 + 8 * (matrix % 2);
  store_tile_matrices<T>(acc, shared_address(set + row * kSetLd + col0 + 8 * (matrix / 2)));
}

// acc (16 x 16) += a b for a 16 x 16 A fragment and the two n8 halves of a B fragment.
template <typename T>
__device__ __forceinline__ void mma_pair(TileAccumulator& acc, const unsigned (&a)[4],
                                         const unsigned (&b)[4]) {
  frag::mma16816<T>(acc.x[0], a, b[0], b[1]);
  frag::mma16816<T>(acc.x[1], a, b[2], b[3]);
}

// One block's slice of a state, phi^T x over the block's tokens (64 features x 16 columns), into
// its row of a slice set. phi and x point at this lane's ldmatrix rows (A: phi stored by token;
// B: x [token][column]). Steps > 0: that many 16-token steps, known at compile time; 0: tokens
// / 16.
template <typename T, int Steps>
__device__ __forceinline__ void block_slice(const T* phi, const T* x, T* block_row, int tokens) {
  constexpr int ld = kTileLd;
  // Two feature tiles at a time: the registers hold dphi(q) and dphi(k) all along.
#pragma unroll
  for (int fm0 = 0; fm0 < kD / 16; fm0 += 2) {
    TileAccumulator acc[2];
    acc[0].zero(), acc[1].zero();
    const int steps = Steps > 0 ? Steps : tokens / 16;
#pragma unroll(Steps > 0 ? Steps : 1)
    for (int step = 0; step < steps; ++step) {
      unsigned xb[4];
      frag::load_matrices<true>(xb, x + 16 * step * ld);
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        unsigned pa[4];
        frag::load_matrices<true>(pa, phi + 16 * step * ld + 16 * (fm0 + u));
        mma_pair<T>(acc[u], pa, xb);
      }
    }
#pragma unroll
    for (int u = 0; u < 2; ++u) store_state_tile<T>(acc[u], block_row, 16 * (fm0 + u));
  }
}

// The tiles' preparation, each thread's rows read before any is used. First phi(q) and phi(k) in
// place with their 1/rms (while do and o may still be arriving), then g = do / (den + eps) in
// place of do with gd = -(do . o) / (den + eps). Padding rows: zero. The same results as the
// scores kernels' features_in_place and scale_gradient_in_place.
template <typename T>
struct RowPasses {
  using L = Layout<T, kD>;
  static constexpr int rows_per_pass = kBackwardThreads / L::lanes;
  static constexpr int passes = kStrips * kStrip / rows_per_pass;
  __device__ static int row(int pass) {
    return static_cast<int>(threadIdx.x) / L::lanes + pass * rows_per_pass;
  }
  __device__ static int offset(int pass) {
    return row(pass) * kTileLd + static_cast<int>(threadIdx.x) % L::lanes * L::vec;
  }
};

template <typename T>
__device__ __forceinline__ void prepare_features(T* qf, T* kf, int n, int padded, float* inv_rms_q,
                                                 float* inv_rms_k) {
  using R = RowPasses<T>;
  uint4 q[R::passes], k[R::passes];
#pragma unroll
  for (int i = 0; i < R::passes; ++i) {
    if (R::row(i) < padded) {
      q[i] = *reinterpret_cast<const uint4*>(qf + R::offset(i));
      k[i] = *reinterpret_cast<const uint4*>(kf + R::offset(i));
    }
  }
#pragma unroll
  for (int i = 0; i < R::passes; ++i) {
    const int r = R::row(i);
    if (r >= padded) continue;  // whole warps: padded is a multiple of 16
    const float q_scale = features_of_piece<T, R::L::lanes>(q[i], r < n),
                k_scale = features_of_piece<T, R::L::lanes>(k[i], r < n);
    *reinterpret_cast<uint4*>(qf + R::offset(i)) = q[i];
    *reinterpret_cast<uint4*>(kf + R::offset(i)) = k[i];
    if (threadIdx.x % R::L::lanes == 0) inv_rms_q[r] = q_scale, inv_rms_k[r] = k_scale;
  }
}

// g = do / (den + eps) in place of do, and 1 / (den + eps) in gd for gd_from_strip at the end
// (padding rows: zero).
template <typename T>
__device__ __forceinline__ void prepare_gradient(T* gs, const float* den, int n, int padded,
                                                 float* gd) {
  using R = RowPasses<T>;
  uint4 g[R::passes];
#pragma unroll
  for (int i = 0; i < R::passes; ++i) {
    if (R::row(i) < padded) g[i] = *reinterpret_cast<const uint4*>(gs + R::offset(i));
  }
#pragma unroll
  for (int i = 0; i < R::passes; ++i) {
    const int r = R::row(i);
    if (r >= padded) continue;
    const float scale = r < n ? 1.f / (den[r] + kDenominatorEps) : 0.f;
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      // do * scale on packed pairs, scale split into high and low parts (one rounding, as in
      // fp32). Only for bf16: a small denominator can put the scale past fp16's range.
      using P = Pair<T>;
      const T high = from_float<T>(scale), low = from_float<T>(scale - to_float(high));
      const P s_hi = P(high, high), s_lo = P(low, low);
      P* pairs = reinterpret_cast<P*>(&g[i]);
#pragma unroll
      for (int e = 0; e < R::L::vec / 2; ++e)
        pairs[e] = __hfma2(pairs[e], s_hi, __hmul2(pairs[e], s_lo));
    } else {
      T* grad = reinterpret_cast<T*>(&g[i]);
#pragma unroll
      for (int e = 0; e < R::L::vec; ++e) grad[e] = from_float<T>(to_float(grad[e]) * scale);
    }
    *reinterpret_cast<uint4*>(gs + R::offset(i)) = g[i];
    if (threadIdx.x % R::L::lanes == 0) gd[r] = scale;
  }
}

// gd_t = -(do_t . o_t) / (den_t + eps) without o: do . o = g . (phi(q) S') = phi(q) . (g S'^T),
// and g S'^T is what the warp's dq accumulators hold after the slices. On entry gd holds
// 1 / (den + eps) (prepare_gradient); the strip's rows of gd are overwritten, and the
// lane's two rows (TileAccumulator::row(0) and row(2)) returned.
template <typename T>
__device__ __forceinline__ float2 gd_from_strip(const TileAccumulator (&dq)[kD / 16], const T* qf,
                                                float* gd, int row0) {
  const int r_lo = row0 + TileAccumulator::row(0), r_hi = row0 + TileAccumulator::row(2);
  float dot_lo = 0.f, dot_hi = 0.f;
#pragma unroll
  for (int fn = 0; fn < kD / 16; ++fn) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int f = 16 * fn + TileAccumulator::col(half, 0);
      const T* lo = qf + r_lo * kTileLd + f;
      const T* hi = qf + r_hi * kTileLd + f;
      dot_lo += dq[fn].x[half][0] * to_float(lo[0]) + dq[fn].x[half][1] * to_float(lo[1]);
      dot_hi += dq[fn].x[half][2] * to_float(hi[0]) + dq[fn].x[half][3] * to_float(hi[1]);
    }
  }
#pragma unroll
  for (int offset = 1; offset < 4; offset *= 2) {  // the row's four lanes
    dot_lo += __shfl_xor_sync(0xffffffffu, dot_lo, offset);
    dot_hi += __shfl_xor_sync(0xffffffffu, dot_hi, offset);
  }
  const float2 result = make_float2(-dot_lo * gd[r_lo], -dot_hi * gd[r_hi]);
  __syncwarp();
  if (threadIdx.x % 4 == 0) gd[r_lo] = result.x, gd[r_hi] = result.y;
  __syncwarp();
  return result;
}

// cp.async groups: the copies issued so far close a group; wait until at most `Pending` groups
// are still in flight.
__device__ __forceinline__ void close_copy_group() {
  asm volatile("cp.async.commit_group;\n" ::);
}
template <int Pending>
__device__ __forceinline__ void wait_copy_groups() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(Pending));
}

// A strip's raw input rows for the feature backward of dq or dk: each lane's 16-byte pieces of
// the rows it writes, loaded before the strip's gradient is ready (zero past the end).
template <typename T>
__device__ __forceinline__ void load_raw_strip(const TokenTensor& src, int b, int h, int n,
                                               int row0, uint4 (&raw)[kStripPasses]) {
  using L = Layout<T, kD>;
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int pass = 0; pass < kStripPasses; ++pass) {
    const int token = row0 + lane / L::lanes + pass * (32 / L::lanes);
    raw[pass] = token < n ? *reinterpret_cast<const uint4*>(token_row<T, kD>(src, b, token, h) +
                                                            (lane % L::lanes) * L::vec)
                          : make_uint4(0, 0, 0, 0);
  }
}

// A staged strip of d(phi) (rows row0 .. row0 + 15) through the feature map's backward (raw rows
// from load_raw_strip, 1/rms in inv_rms) into a contiguous [B, N, H, D] gradient.
template <typename T>
__device__ __forceinline__ void store_feature_gradient(const float* stage,
                                                       const uint4 (&raw)[kStripPasses],
                                                       const float* inv_rms, T* dst, int b, int h,
                                                       int heads, int n, int row0) {
  using L = Layout<T, kD>;
  constexpr int ld = ResidentLayout<kD>::stage_ld;
  const int lane = threadIdx.x % 32, c = (lane % L::lanes) * L::vec;
#pragma unroll
  for (int pass = 0; pass < kStripPasses; ++pass) {
    const int r = lane / L::lanes + pass * (32 / L::lanes), token = row0 + r;
    const bool live = token < n;
    float g[L::vec], x[L::vec];
    const float4 g0 = *reinterpret_cast<const float4*>(stage + r * ld + c);
    const float4 g1 = *reinterpret_cast<const float4*>(stage + r * ld + c + 4);
    g[0] = g0.x, g[1] = g0.y, g[2] = g0.z, g[3] = g0.w;
    g[4] = g1.x, g[5] = g1.y, g[6] = g1.z, g[7] = g1.w;
    const T* words = reinterpret_cast<const T*>(&raw[pass]);
#pragma unroll
    for (int e = 0; e < L::vec; ++e) x[e] = to_float(words[e]);
    feature_backward<T, kD>(x, live ? inv_rms[token] : 0.f, g);
    if (live) {
      const size_t index = (static_cast<size_t>(b) * n + token) * heads + h;
      store_vector<T, kD>(dst + index * kD + c, g);
    }
  }
}

// Two adjacent 16-bit elements as floats.
template <typename T>
__device__ __forceinline__ float2 load_pair(const T* at) {
  const Pair<T> pair = *reinterpret_cast<const Pair<T>*>(at);
  return make_float2(to_float(pair.x), to_float(pair.y));
}

__device__ __forceinline__ float2 fma2(float a, float2 x, float2 acc) {
  return make_float2(fmaf(a, x.x, acc.x), fmaf(a, x.y, acc.y));
}

// dz_j = sum_i m_ij dz'_i, and dm's z part dw_ij = dz'_i . z_j (the warps' <dS', S> parts join
// it at the end). Reads dz' and z, writes dz and dw.
__device__ __forceinline__ void query_normalizer_terms(const float* w, const float* dz_query,
                                                       const float* z, int blocks, float* dz,
                                                       float* dw) {
  constexpr int pairs = kD / 2;  // each thread takes two adjacent features
  for (int e = threadIdx.x; e < blocks * pairs; e += blockDim.x) {
    const int block = e / pairs, f = 2 * (e % pairs);
    float2 spread = make_float2(0.f, 0.f);
    for (int i = 0; i < blocks; ++i)
      spread = fma2(w[i * blocks + block], *reinterpret_cast<const float2*>(dz_query + i * kD + f),
                    spread);
    *reinterpret_cast<float2*>(dz + block * kD + f) = spread;
  }
  for (int e = threadIdx.x; e < blocks * blocks; e += blockDim.x) {
    const int i = e / blocks, j = e % blocks;
    float dot = 0.f;
#pragma unroll 4
    for (int step = 0; step < kD; step += 4) {
      const int f = (step + 4 * j) % kD;  // lanes of different j read different banks
      const float4 a = *reinterpret_cast<const float4*>(dz_query + i * kD + f);
      const float4 c = *reinterpret_cast<const float4*>(z + j * kD + f);
      dot += a.x * c.x + a.y * c.y + a.z * c.z + a.w * c.w;
    }
    dw[e] = dot;
  }
}

template <typename T>
__global__ void __launch_bounds__(kBackwardThreads, 1)
    resident_state_backward_kernel(ResidentBlockLinearBackward p) {
  constexpr int D = kD, ld = kTileLd;
  extern __shared__ __align__(128) unsigned char smem[];
  const auto& s = p.shape;
  const int n = s.tokens, strips = (n + kStrip - 1) / kStrip, padded = strips * kStrip;
  const int bh = blockIdx.x, b = bh / s.heads, h = bh % s.heads;
  const int blocks = s.blocks, block_tokens = padded / blocks;
  const StateBackwardLayout layout(padded);
  T* qf = reinterpret_cast<T*>(smem + layout.qf);
  T* kf = reinterpret_cast<T*>(smem + layout.kf);
  T* vs = reinterpret_cast<T*>(smem + layout.vs);
  T* gs = reinterpret_cast<T*>(smem + layout.gs);
  T* set_s = reinterpret_cast<T*>(smem + layout.sets);  // S, then S' (per slice)
  T* set_d = set_s + kSetBlocks * kSetLd;               // dS', then dS
  float* gd = reinterpret_cast<float*>(smem + layout.gd);
  float* inv_rms_q = reinterpret_cast<float*>(smem + layout.rms_q);
  float* inv_rms_k = reinterpret_cast<float*>(smem + layout.rms_k);
  T* w_hi = reinterpret_cast<T*>(smem + layout.w_hi);
  T* w_lo = reinterpret_cast<T*>(smem + layout.w_lo);
  float* w = reinterpret_cast<float*>(smem + layout.w);
  float* z_mixed = reinterpret_cast<float*>(smem + layout.z_mixed);
  float* dz = reinterpret_cast<float*>(smem + layout.dz);
  float* dw = reinterpret_cast<float*>(smem + layout.dw);
  // z stays in dz's space until the end, where gd becomes known (dz is written last).
  float* z = dz;

  // Three copy groups, in the order the work needs them: q and k, then do, then v. The forward's
  // output is not read: gd comes from dq at the end (gd_from_strip).
  copy_rows<T, D, kBackwardThreads>(p.q, b, h, n, padded, qf);
  copy_rows<T, D, kBackwardThreads>(p.k, b, h, n, padded, kf);
  close_copy_group();
  copy_rows<T, D, kBackwardThreads>(p.grad_out, b, h, n, padded, gs);
  close_copy_group();
  copy_rows<T, D, kBackwardThreads>(p.v, b, h, n, padded, vs);
  close_copy_group();
  for (int e = threadIdx.x; e < kSetBlocks * kSetBlocks; e += blockDim.x) {
    const int i = e / kSetBlocks, j = e % kSetBlocks;
    const float weight = i < blocks && j < blocks ? p.mixing[i * blocks + j] : 0.f;
    if (i < blocks && j < blocks) w[i * blocks + j] = weight;
    const T high = from_float<T>(weight);
    w_hi[i * kMixLd + j] = high;
    w_lo[i * kMixLd + j] = from_float<T>(weight - to_float(high));
  }
  wait_copy_groups<2>();
  __syncthreads();
  prepare_features<T>(qf, kf, n, padded, inv_rms_q, inv_rms_k);
  wait_copy_groups<1>();
  __syncthreads();
  prepare_gradient<T>(gs, p.den + static_cast<size_t>(bh) * n, n, padded, gd);
  __syncthreads();

  // The normalizer's key terms, per (block, feature pair): z_j, mixed into z'.
  constexpr int pairs = D / 2;
  for (int e = threadIdx.x; e < blocks * pairs; e += blockDim.x) {
    const int block = e / pairs, f = 2 * (e % pairs), t0 = block * block_tokens;
    float2 key_sum = make_float2(0.f, 0.f);
    for (int t = t0; t < t0 + block_tokens; ++t) {
      const float2 x = load_pair(kf + t * ld + f);
      key_sum.x += x.x, key_sum.y += x.y;
    }
    *reinterpret_cast<float2*>(z + block * D + f) = key_sum;
  }
  __syncthreads();
  for (int e = threadIdx.x; e < blocks * pairs; e += blockDim.x) {
    const int block = e / pairs, f = 2 * (e % pairs);
    float2 mixed = make_float2(0.f, 0.f);
    for (int j = 0; j < blocks; ++j)
      mixed = fma2(w[block * blocks + j], *reinterpret_cast<const float2*>(z + j * D + f), mixed);
    *reinterpret_cast<float2*>(z_mixed + block * D + f) = mixed;
  }
  wait_async_copies();  // v, before phase A
  __syncthreads();
  // Set rows past the last block: phase A never writes them, the mixing multiplies them by zero.
  for (int e = threadIdx.x; e < (kSetBlocks - blocks) * kSetLd / 2; e += blockDim.x) {
    reinterpret_cast<uint32_t*>(set_s + blocks * kSetLd)[e] = 0u;
    reinterpret_cast<uint32_t*>(set_d + blocks * kSetLd)[e] = 0u;
  }

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int quad = lane / 8, row8 = lane % 8;
  const bool owns_strip = warp < strips;
  const int row0 = warp * kStrip, strip_block = owns_strip ? row0 / block_tokens : 0;
  TileAccumulator dq[D / 16], dk[D / 16], dm;
#pragma unroll
  for (int j = 0; j < D / 16; ++j) dq[j].zero(), dk[j].zero();
  dm.zero();

  for (int slice = 0; slice < kSlices; ++slice) {
    const int c0 = slice * kSlice;
    // A: S_j = phi(K_j)^T V_j and dS'_i = phi(Q_i)^T g_i, this slice's columns: one (side,
    // block) per warp task, its feature tiles sharing each token step's B fragment.
    for (int unit = warp; unit < 2 * blocks; unit += kStrips) {
      const bool query_side = unit >= blocks;
      const int block = query_side ? unit - blocks : unit;
      const size_t first_row = static_cast<size_t>(block) * block_tokens;
      const T* phi = (query_side ? qf : kf) + (first_row + (quad / 2) * 8 + row8) * ld +
                     (quad % 2) * 8;  // A [m = feature][k = token], stored by token
      const T* x = (query_side ? gs : vs) + (first_row + (quad % 2) * 8 + row8) * ld + c0 +
                   (quad / 2) * 8;  // B [k = token][n = column]
      T* block_row = (query_side ? set_d : set_s) + block * kSetLd;
      if (block_tokens == kStrip) {  // the vision shape: one token step, unrolled
        block_slice<T, 1>(phi, x, block_row, kStrip);
      } else {
        block_slice<T, 0>(phi, x, block_row, block_tokens);
      }
    }
    __syncthreads();

    // B: S' = m S, dS = m^T dS' and dm += dS' S^T, 16 physical columns at a time, in place.
    {
      unsigned mix_hi[4], mix_lo[4], mix_t_hi[4], mix_t_lo[4];
      const int a_plain = ((quad % 2) * 8 + row8) * kMixLd + (quad / 2) * 8;
      const int a_transposed = ((quad / 2) * 8 + row8) * kMixLd + (quad % 2) * 8;
      frag::load_matrices<false>(mix_hi, w_hi + a_plain);
      frag::load_matrices<false>(mix_lo, w_lo + a_plain);
      frag::load_matrices<true>(mix_t_hi, w_hi + a_transposed);
      frag::load_matrices<true>(mix_t_lo, w_lo + a_transposed);
      const int k_rows = ((quad % 2) * 8 + row8) * kSetLd + (quad / 2) * 8;  // B [k = block][n]
      const int n_rows = ((quad / 2) * 8 + row8) * kSetLd + (quad % 2) * 8;  // B [n = block][k]
      for (int col0 = 16 * warp; col0 < kD * kSlice; col0 += 16 * kStrips) {
        unsigned states[4], grads[4], grads_a[4], states_n[4];
        frag::load_matrices<true>(states, set_s + col0 + k_rows);
        frag::load_matrices<true>(grads, set_d + col0 + k_rows);
        frag::load_matrices<false>(grads_a, set_d + col0 + k_rows);  // A [m = block][k]
        frag::load_matrices<false>(states_n, set_s + col0 + n_rows);
        TileAccumulator mixed, spread;
        mixed.zero(), spread.zero();
        mma_pair<T>(mixed, mix_hi, states);
        mma_pair<T>(mixed, mix_lo, states);
        mma_pair<T>(spread, mix_t_hi, grads);
        mma_pair<T>(spread, mix_t_lo, grads);
        mma_pair<T>(dm, grads_a, states_n);
        __syncwarp();
        store_set_tile<T>(mixed, set_s, col0);
        store_set_tile<T>(spread, set_d, col0);
      }
    }
    __syncthreads();

    // C: this warp's strip: dphi(q) += g S'^T, dphi(k) += v dS^T, dv = phi(k) dS.
    if (owns_strip) {
      const T* mixed = set_s + strip_block * kSetLd;
      const T* spread = set_d + strip_block * kSetLd;
      const int a_rows = ((quad % 2) * 8 + row8) * ld + (quad / 2) * 8;
      unsigned ga[4], va[4];
      frag::load_matrices<false>(ga, gs + row0 * ld + c0 + a_rows);
      frag::load_matrices<false>(va, vs + row0 * ld + c0 + a_rows);
#pragma unroll
      for (int fn = 0; fn < D / 16; ++fn) {
        // B [k = slice column][n = feature], stored by feature: rows f, the k half quad % 2.
        const int f = 16 * fn + (quad / 2) * 8 + row8;
        unsigned sb[4], db[4];
        frag::load_matrices<false>(sb, mixed + state_offset(f, quad % 2));
        frag::load_matrices<false>(db, spread + state_offset(f, quad % 2));
        mma_pair<T>(dq[fn], ga, sb);
        mma_pair<T>(dk[fn], va, db);
      }
      TileAccumulator dv;
      dv.zero();
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        // B [k = feature][n = slice column]: rows f, the n half quad / 2, transposed.
        const int f = 16 * kk + (quad % 2) * 8 + row8;
        unsigned ka[4], db[4];
        frag::load_matrices<false>(ka, kf + row0 * ld + 16 * kk + a_rows);
        frag::load_matrices<true>(db, spread + state_offset(f, quad / 2));
        mma_pair<T>(dv, ka, db);
      }
      T* grad_v = static_cast<T*>(p.grad_v);
#pragma unroll
      for (int i = 0; i < 4; i += 2) {
        const int token = row0 + TileAccumulator::row(i);
        if (token < n) {
          T* row = grad_v + ((static_cast<size_t>(b) * n + token) * s.heads + h) * D + c0;
#pragma unroll
          for (int half = 0; half < 2; ++half)
            store_pair<T>(row + TileAccumulator::col(half, i), dv.x[half][i], dv.x[half][i + 1]);
        }
      }
    }
    __syncthreads();  // the next slice's phase A overwrites the sets
  }

  // The strips' raw rows for the feature backward, each loaded a step before it is used: q's
  // while the rank-one terms are added, k's while dq is written.
  // dm: each warp's part of <dS', S> into the free sets region, summed with the z part below.
  float* dm_parts = reinterpret_cast<float*>(smem + layout.sets);
  dm.store(dm_parts + warp * kSetBlocks * kSetBlocks, kSetBlocks);
  // gd from the strips' dq, then dz' = sum_t gd_t phi(q_t) per block (strip parts first), dz and
  // dm's z part; in the sets region past the dm parts.
  float* strip_parts = dm_parts + kStrips * kSetBlocks * kSetBlocks;  // [strip][D]
  float* query_terms = strip_parts + kStrips * D;                     // dz' [block][D]
  float* spread = query_terms + kSetBlocks * D;                       // dz [block][D]
  float2 strip_gd = make_float2(0.f, 0.f);  // this lane's rows TileAccumulator::row(0), row(2)
  if (owns_strip) {
    strip_gd = gd_from_strip<T>(dq, qf, gd, row0);
    static_assert(D == 64, "one feature pair per lane");
    float2 sum = make_float2(0.f, 0.f);
#pragma unroll 4
    for (int r = row0; r < row0 + kStrip; ++r)
      sum = fma2(gd[r], load_pair(qf + r * ld + 2 * lane), sum);
    *reinterpret_cast<float2*>(strip_parts + warp * D + 2 * lane) = sum;
  }
  __syncthreads();
  const int strips_per_block = block_tokens / kStrip;
  for (int e = threadIdx.x; e < blocks * pairs; e += blockDim.x) {
    const int block = e / pairs, f = 2 * (e % pairs);
    float2 sum = make_float2(0.f, 0.f);
    for (int strip = block * strips_per_block; strip < (block + 1) * strips_per_block; ++strip) {
      const float2 part = *reinterpret_cast<const float2*>(strip_parts + strip * D + f);
      sum.x += part.x, sum.y += part.y;
    }
    *reinterpret_cast<float2*>(query_terms + block * D + f) = sum;
  }
  __syncthreads();
  query_normalizer_terms(w, query_terms, z, blocks, spread, dw);
  __syncthreads();
  if (owns_strip) {
    uint4 raw[kStripPasses];
    load_raw_strip<T>(p.q, b, h, n, row0, raw);
    // The rank-one terms: gd_t z'_i into dphi(q_t), dz_j into every dphi(k_s) of block j.
#pragma unroll
    for (int fn = 0; fn < D / 16; ++fn) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int f = strip_block * D + 16 * fn + TileAccumulator::col(half, 0);
        const float2 z_pair = *reinterpret_cast<const float2*>(z_mixed + f);
        const float2 dz_pair = *reinterpret_cast<const float2*>(spread + f);
        TileAccumulator& q_tile = dq[fn];
        q_tile.x[half][0] += strip_gd.x * z_pair.x, q_tile.x[half][1] += strip_gd.x * z_pair.y;
        q_tile.x[half][2] += strip_gd.y * z_pair.x, q_tile.x[half][3] += strip_gd.y * z_pair.y;
        TileAccumulator& k_tile = dk[fn];
        k_tile.x[half][0] += dz_pair.x, k_tile.x[half][1] += dz_pair.y;
        k_tile.x[half][2] += dz_pair.x, k_tile.x[half][3] += dz_pair.y;
      }
    }
    // Staging strips in vs and gs (exactly their size), past the dm parts.
    constexpr int stage_ld = ResidentLayout<D>::stage_ld;
    float* stage = reinterpret_cast<float*>(smem + layout.vs) + warp * kStrip * stage_ld;
#pragma unroll
    for (int fn = 0; fn < D / 16; ++fn) dq[fn].store(stage + 16 * fn, stage_ld);
    uint4 raw_k[kStripPasses];
    load_raw_strip<T>(p.k, b, h, n, row0, raw_k);
    __syncwarp();
    store_feature_gradient<T>(stage, raw, inv_rms_q, static_cast<T*>(p.grad_q), b, h, s.heads, n,
                              row0);
    __syncwarp();
#pragma unroll
    for (int fn = 0; fn < D / 16; ++fn) dk[fn].store(stage + 16 * fn, stage_ld);
    __syncwarp();
    store_feature_gradient<T>(stage, raw_k, inv_rms_k, static_cast<T*>(p.grad_k), b, h, s.heads, n,
                              row0);
  }
  __syncthreads();
  for (int e = threadIdx.x; e < blocks * blocks; e += blockDim.x) {
    const int i = e / blocks, j = e % blocks;
    float total = dw[e];
    for (int w = 0; w < kStrips; ++w)
      total += dm_parts[w * kSetBlocks * kSetBlocks + i * kSetBlocks + j];
    if (p.grad_mixing_parts != nullptr) {
      p.grad_mixing_parts[static_cast<size_t>(blockIdx.x) * blocks * blocks + e] = total;
    } else if (total != 0.f) {
      atomicAdd(p.grad_mixing + e, total);
    }
  }
}

template <typename T>
cudaError_t launch(const ResidentBlockLinearBackward& a, cudaStream_t stream) {
  const auto& s = a.shape;
  cudaError_t err = cudaSuccess;
  if (a.grad_mixing_parts == nullptr &&
      (err = cudaMemsetAsync(a.grad_mixing, 0, sizeof(float) * s.blocks * s.blocks, stream)) !=
          cudaSuccess)
    return err;
  const size_t bytes = StateBackwardLayout(padded_tokens(s)).total;
  if ((err = allow_smem(resident_state_backward_kernel<T>, bytes)) != cudaSuccess) return err;
  resident_state_backward_kernel<T><<<s.batch * s.heads, kBackwardThreads, bytes, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace

bool resident_state_backward_supported(const BlockLinearShape& s, DType dtype) {
  if (!resident_block_linear_supported(s, dtype)) return false;
  if (s.head_dim != kD || s.blocks > kSetBlocks) return false;
  const int padded = padded_tokens(s);
  if (padded / kStrip > kStrips) return false;  // one strip per warp
  return StateBackwardLayout(padded).total <= kResidentSmemLimit;
}

cudaError_t resident_state_backward(const ResidentBlockLinearBackward& args, cudaStream_t stream) {
  if (!resident_state_backward_supported(args.shape, args.dtype) || args.den == nullptr ||
      args.mixing == nullptr || args.grad_mixing == nullptr)
    return cudaErrorInvalidValue;
  return args.dtype == DType::bf16 ? launch<__nv_bfloat16>(args, stream)
                                   : launch<__half>(args, stream);
}

}  // namespace mhla_kernels
