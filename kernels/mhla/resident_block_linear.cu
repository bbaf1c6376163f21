// Short-sequence block linear attention with the sequence resident in shared memory: see
// resident_block_linear.h. One CTA per (batch, head): 8 warps in the forward (two CTAs share an
// SM), 16 in the backward (its four tiles fill the shared memory of an SM). Each warp owns 16-row
// strips of queries (forward, backward dq) or keys (backward dk, dv) and sweeps the other side in
// 16-token chunks with mma.sync m16n8k16 (fp32 accumulation). Fragments come from padded
// shared-memory rows through ldmatrix (transposed where the product needs the other orientation).
#include <cstdint>

#include "mhla/resident_block_linear.h"
#include "mhla/tiles.cuh"

namespace mhla_kernels {
namespace {

using namespace tiles;

constexpr int kStrip = 16;  // tokens per warp strip and per chunk of the other side
// The forward runs two 8-warp CTAs per SM; the backward's tiles allow one CTA per SM, so it
// runs 16 warps (one strip each at N = 256) to keep the tensor cores fed.
constexpr int kForwardThreads = 256;  // two CTAs per SM at <= 128 registers
constexpr int kForwardWarps = kForwardThreads / 32;
constexpr int kBackwardThreads = 512;
constexpr int kBackwardWarps = kBackwardThreads / 32;
constexpr size_t kResidentSmemLimit = 227 * 1024;

template <int D>
constexpr int max_tokens() {
  return D == 32 ? 512 : 256;
}

__device__ __forceinline__ unsigned shared_address(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// Four 8 x 8 matrices of 16-bit elements; each lane passes the address of one row.
__device__ __forceinline__ void load_matrices(uint32_t (&r)[4], unsigned address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}
__device__ __forceinline__ void load_matrices_transposed(uint32_t (&r)[4], unsigned address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}

// 16 bytes global -> shared without passing through registers; many in flight per thread.
__device__ __forceinline__ void copy_async(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(shared_address(dst)), "l"(src));
}
__device__ __forceinline__ void wait_async_copies() {
  asm volatile("cp.async.wait_all;\n" ::);
}

// c (16 x 8, fp32) += a (16 x 16) b (16 x 8).
template <typename T>
__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                    uint32_t b1) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

template <typename T>
__device__ __forceinline__ uint32_t pack(float lo, float hi) {
  uint32_t bits;
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    bits = *reinterpret_cast<const uint32_t*>(&v);
  } else {
    const __half2 v = __floats2half2_rn(lo, hi);
    bits = *reinterpret_cast<const uint32_t*>(&v);
  }
  return bits;
}

// Shared addresses each lane hands to ldmatrix for a 16 x 16 region at (row0, col0) of a
// row-major tile of 16-bit elements with leading dimension ld, as 32-bit shared-space byte
// addresses (the per-lane part computed once, the region's part a multiply-add):
//  - `a`: as the A operand (rows = m, columns = k), or, transposed, as the B operands of two n8
//    tiles when rows are k and columns n;
//  - `b`: as the B operands of two n8 tiles when rows are n and columns k (not transposed).
template <int ld>
struct FragmentAddress {
  unsigned a, b;  // per-lane byte offsets
  __device__ explicit FragmentAddress(int lane)
      : a(((lane % 16) * ld + 8 * (lane / 16)) * 2),
        b(((lane % 8 + 8 * (lane / 16)) * ld + 8 * ((lane / 8) % 2)) * 2) {}
  __device__ static unsigned region(unsigned tile, int row0, int col0) {
    return tile + (row0 * ld + col0) * 2;
  }
};

// Steps through 16-token chunks and the block each lies in, without dividing.
struct ChunkBlocks {
  int block = 0, left;
  const int per_block;
  __device__ explicit ChunkBlocks(int chunks_per_block)
      : left(chunks_per_block), per_block(chunks_per_block) {}
  __device__ void next() {
    if (--left == 0) left = per_block, ++block;
  }
};

// Two n8 accumulator tiles (16 x 16) as the A operand of the next product, scaled by w.
template <typename T>
__device__ __forceinline__ void to_operand(uint32_t (&a)[4], const float (&c)[2][4], float w) {
  a[0] = pack<T>(c[0][0] * w, c[0][1] * w);
  a[1] = pack<T>(c[0][2] * w, c[0][3] * w);
  a[2] = pack<T>(c[1][0] * w, c[1][1] * w);
  a[3] = pack<T>(c[1][2] * w, c[1][3] * w);
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

// Block of a 16-token strip or chunk: chunks_per_block 16-token chunks make one block.
struct BlockGeometry {
  int blocks, chunks_per_block;
  __host__ __device__ BlockGeometry(const BlockLinearShape& s, int strips)
      : blocks(s.blocks), chunks_per_block(s.blocks == 1 ? strips : s.tokens / s.blocks / kStrip) {}
  __device__ int of(int strip) const { return strip / chunks_per_block; }
};

template <int D>
struct ResidentLayout {
  static constexpr int ld = D + 8;        // elements per shared row (conflict-free ldmatrix)
  static constexpr int stage_ld = D + 8;  // floats per row of a warp's fp32 staging strip
  __host__ __device__ static size_t tile_bytes(int padded) {
    return align128(static_cast<size_t>(padded) * ld * 2);
  }
  static size_t forward_bytes(int padded, int blocks) {
    return 3 * tile_bytes(padded) + align128(static_cast<size_t>(blocks) * blocks * 4);
  }
  // The forward's output tile o, read once while the gradient is prepared, shares its space
  // with the warps' fp32 staging strips, used only afterwards.
  __host__ __device__ static size_t out_or_stages_bytes(int padded) {
    const size_t stages = align128(static_cast<size_t>(kBackwardWarps) * kStrip * stage_ld * 4);
    const size_t out = tile_bytes(padded);
    return stages > out ? stages : out;
  }
  static size_t backward_bytes(int padded, int blocks) {
    return 4 * tile_bytes(padded) + 3 * align128(static_cast<size_t>(padded) * 4) +
           align128(static_cast<size_t>(blocks) * blocks * 4) +
           align128(static_cast<size_t>(padded / kStrip) * blocks * 4) +
           out_or_stages_bytes(padded);
  }
};

// A warp's 16 x D accumulators into its fp32 staging strip [16][stage_ld].
template <int D>
__device__ __forceinline__ void stage_strip(float* stage, const float (&acc)[D / 8][4], int lane) {
  constexpr int ld = ResidentLayout<D>::stage_ld;
  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int j = 0; j < D / 8; ++j) {
    *reinterpret_cast<float2*>(stage + g * ld + 8 * j + 2 * t) = make_float2(acc[j][0], acc[j][1]);
    *reinterpret_cast<float2*>(stage + (g + 8) * ld + 8 * j + 2 * t) =
        make_float2(acc[j][2], acc[j][3]);
  }
}

// Writes a staged strip (rows row0 .. row0 + 15) into a contiguous [B, N, H, D] gradient; with
// `features`, through the backward of the feature map of the raw rows of src (1/rms in inv_rms).
template <typename T, int D>
__device__ void store_strip(const float* stage, T* dst, int b, int h, int heads, int n, int row0,
                            int lane, const TokenTensor* features, const float* inv_rms) {
  using L = Layout<T, D>;
  constexpr int ld = ResidentLayout<D>::stage_ld;
  constexpr int rows_per_pass = 32 / L::lanes;
  const int c = (lane % L::lanes) * L::vec;
  for (int r = lane / L::lanes; r < kStrip; r += rows_per_pass) {  // uniform trip count
    const int token = row0 + r;
    const bool live = token < n;
    float g[L::vec];
#pragma unroll
    for (int i = 0; i < L::vec; ++i) g[i] = stage[r * ld + c + i];
    if (features != nullptr) {
      float x[L::vec];
      if (live) {
        load_vector<T, D>(token_row<T, D>(*features, b, token, h) + c, x);
      } else {
#pragma unroll
        for (int i = 0; i < L::vec; ++i) x[i] = 0.f;
      }
      feature_backward<T, D>(x, live ? inv_rms[token] : 0.f, g);
    }
    if (live) {
      const size_t index = (static_cast<size_t>(b) * n + token) * heads + h;
      store_vector<T, D>(dst + index * D + c, g);
    }
  }
}

// Starts copying the n token rows of one (batch, head) into a padded shared tile; rows up to
// `padded` are zero-filled. Complete after wait_async_copies() and a barrier.
template <typename T, int D>
__device__ void copy_rows(const TokenTensor& src, int b, int h, int n, int padded, T* tile) {
  constexpr int ld = ResidentLayout<D>::ld, per_row = D / 8;  // 16-byte pieces per row
  for (int piece = threadIdx.x; piece < padded * per_row; piece += blockDim.x) {
    const int r = piece / per_row, c = (piece % per_row) * 8;
    if (r < n) {
      copy_async(tile + r * ld + c, token_row<T, D>(src, b, r, h) + c);
    } else {
      *reinterpret_cast<uint4*>(tile + r * ld + c) = make_uint4(0, 0, 0, 0);
    }
  }
}

// phi(x) = relu(x / rms(x)) + floor of every row of a shared tile, in place (padding rows
// become zero, not the floor); 1/rms per row into inv_rms when asked.
template <typename T, int D>
__device__ void features_in_place(T* tile, int n, int padded, float* inv_rms) {
  using L = Layout<T, D>;
  constexpr int ld = ResidentLayout<D>::ld;
  const int lane = threadIdx.x % L::lanes;
  for (int r = threadIdx.x / L::lanes; r < padded; r += blockDim.x / L::lanes) {  // whole warps
    uint4* at = reinterpret_cast<uint4*>(tile + r * ld + lane * L::vec);
    uint4 raw = *at;
    T* values = reinterpret_cast<T*>(&raw);
    float squares = 0.f;
#pragma unroll
    for (int i = 0; i < L::vec; ++i) squares += to_float(values[i]) * to_float(values[i]);
    const float scale = rsqrtf(row_sum<L::lanes>(squares) / D + kNormEps);
#pragma unroll
    for (int i = 0; i < L::vec; ++i) {
      const float phi = r < n ? fmaxf(to_float(values[i]) * scale, 0.f) + kFeatureFloor : 0.f;
      values[i] = from_float<T>(phi);
    }
    *at = raw;
    if (inv_rms != nullptr && lane == 0) inv_rms[r] = scale;
  }
}

template <typename T, int D>
__global__ void __launch_bounds__(kForwardThreads, 2)
    resident_forward_kernel(ResidentBlockLinearForward p) {
  constexpr int ld = ResidentLayout<D>::ld;
  extern __shared__ __align__(128) unsigned char smem[];
  const auto& s = p.shape;
  const int n = s.tokens, strips = (n + kStrip - 1) / kStrip, padded = strips * kStrip;
  const int bh = blockIdx.x, b = bh / s.heads, h = bh % s.heads;
  const size_t tile = ResidentLayout<D>::tile_bytes(padded);
  T* qf = reinterpret_cast<T*>(smem);
  T* kf = reinterpret_cast<T*>(smem + tile);
  T* vs = reinterpret_cast<T*>(smem + 2 * tile);
  float* mix = reinterpret_cast<float*>(smem + 3 * tile);
  const bool mixes = p.mixing != nullptr;
  const BlockGeometry geometry(s, strips);

  copy_rows<T, D>(p.q, b, h, n, padded, qf);
  copy_rows<T, D>(p.k, b, h, n, padded, kf);
  copy_rows<T, D>(p.v, b, h, n, padded, vs);
  if (mixes) {
    for (int e = threadIdx.x; e < s.blocks * s.blocks; e += kForwardThreads) mix[e] = p.mixing[e];
  }
  wait_async_copies();
  __syncthreads();
  features_in_place<T, D>(qf, n, padded, nullptr);
  features_in_place<T, D>(kf, n, padded, nullptr);
  __syncthreads();

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  T* out = static_cast<T*>(p.out);
  using Address = FragmentAddress<ld>;
  const Address lane_address(lane);
  const unsigned q_tile = shared_address(qf), k_tile = shared_address(kf) + lane_address.b,
                 v_tile = shared_address(vs) + lane_address.a;
  for (int strip = warp; strip < strips; strip += kForwardWarps) {
    const int row0 = strip * kStrip;
    uint32_t qa[D / 16][4];
#pragma unroll
    for (int kd = 0; kd < D / 16; ++kd)
      load_matrices(qa[kd], Address::region(q_tile + lane_address.a, row0, 16 * kd));
    float acc[D / 8][4] = {};
    float den_lo = 0.f, den_hi = 0.f;  // rows g and g + 8
    const float* mix_row = mixes ? mix + geometry.of(strip) * s.blocks : nullptr;
    ChunkBlocks key_blocks(geometry.chunks_per_block);
#pragma unroll 2
    for (int chunk = 0; chunk < strips; ++chunk) {
      const int key0 = chunk * kStrip;
      float scores[2][4] = {};
#pragma unroll
      for (int kd = 0; kd < D / 16; ++kd) {
        uint32_t kb[4];
        load_matrices(kb, Address::region(k_tile, key0, 16 * kd));
        mma<T>(scores[0], qa[kd], kb[0], kb[1]);
        mma<T>(scores[1], qa[kd], kb[2], kb[3]);
      }
      const float w = mixes ? mix_row[key_blocks.block] : 1.f;
      key_blocks.next();
      den_lo += w * (scores[0][0] + scores[0][1] + scores[1][0] + scores[1][1]);
      den_hi += w * (scores[0][2] + scores[0][3] + scores[1][2] + scores[1][3]);
      uint32_t pa[4];
      to_operand<T>(pa, scores, w);
#pragma unroll
      for (int dj = 0; dj < D / 16; ++dj) {
        uint32_t vb[4];
        load_matrices_transposed(vb, Address::region(v_tile, key0, 16 * dj));
        mma<T>(acc[2 * dj], pa, vb[0], vb[1]);
        mma<T>(acc[2 * dj + 1], pa, vb[2], vb[3]);
      }
    }
    den_lo += __shfl_xor_sync(0xffffffffu, den_lo, 1);
    den_lo += __shfl_xor_sync(0xffffffffu, den_lo, 2);
    den_hi += __shfl_xor_sync(0xffffffffu, den_hi, 1);
    den_hi += __shfl_xor_sync(0xffffffffu, den_hi, 2);
    const float scale_lo = 1.f / (den_lo + kDenominatorEps);
    const float scale_hi = 1.f / (den_hi + kDenominatorEps);
    // Normalized rows into this strip's own query rows (no other warp reads them), then out with
    // 16-byte row stores.
    __syncwarp();
#pragma unroll
    for (int j = 0; j < D / 8; ++j) {
      T* lo = qf + (row0 + g) * ld + 8 * j + 2 * t;
      *reinterpret_cast<uint32_t*>(lo) = pack<T>(acc[j][0] * scale_lo, acc[j][1] * scale_lo);
      *reinterpret_cast<uint32_t*>(lo + 8 * ld) =
          pack<T>(acc[j][2] * scale_hi, acc[j][3] * scale_hi);
    }
    __syncwarp();
    constexpr int lanes = D / 8, rows_per_pass = 32 / lanes;
    for (int r = lane / lanes; r < kStrip; r += rows_per_pass) {
      const int token = row0 + r;
      if (token < n) {
        const size_t index = (static_cast<size_t>(b) * n + token) * s.heads + h;
        *reinterpret_cast<uint4*>(out + index * D + (lane % lanes) * 8) =
            *reinterpret_cast<const uint4*>(qf + (row0 + r) * ld + (lane % lanes) * 8);
      }
    }
    if (t == 0) {
      if (row0 + g < n) p.den[static_cast<size_t>(bh) * n + row0 + g] = den_lo;
      if (row0 + g + 8 < n) p.den[static_cast<size_t>(bh) * n + row0 + g + 8] = den_hi;
    }
  }
}

// In place: gs holds do, o_tile the forward's output; afterwards gs holds g = do / (den + eps)
// (padding zero) and gd = -(do . o) / (den + eps).
template <typename T, int D>
__device__ void scale_gradient_in_place(const float* den, int n, int padded, T* gs, const T* o_tile,
                                        float* gd) {
  using L = Layout<T, D>;
  constexpr int ld = ResidentLayout<D>::ld;
  const int lane = threadIdx.x % L::lanes;
  for (int r = threadIdx.x / L::lanes; r < padded; r += blockDim.x / L::lanes) {  // whole warps
    uint4* at = reinterpret_cast<uint4*>(gs + r * ld + lane * L::vec);
    uint4 raw = *at;
    const uint4 raw_o = *reinterpret_cast<const uint4*>(o_tile + r * ld + lane * L::vec);
    T* values = reinterpret_cast<T*>(&raw);
    const T* o = reinterpret_cast<const T*>(&raw_o);
    const float scale = r < n ? 1.f / (den[r] + kDenominatorEps) : 0.f;
    float dot = 0.f;
#pragma unroll
    for (int i = 0; i < L::vec; ++i) {
      dot += to_float(values[i]) * to_float(o[i]);
      values[i] = from_float<T>(to_float(values[i]) * scale);
    }
    *at = raw;
    dot = row_sum<L::lanes>(dot);
    if (lane == 0) gd[r] = -dot * scale;
  }
}

template <typename T, int D>
__global__ void __launch_bounds__(kBackwardThreads, 1)
    resident_backward_kernel(ResidentBlockLinearBackward p) {
  using RL = ResidentLayout<D>;
  constexpr int ld = RL::ld;
  extern __shared__ __align__(128) unsigned char smem[];
  const auto& s = p.shape;
  const int n = s.tokens, strips = (n + kStrip - 1) / kStrip, padded = strips * kStrip;
  const int bh = blockIdx.x, b = bh / s.heads, h = bh % s.heads;
  const int blocks = s.blocks;
  const bool mixes = p.mixing != nullptr;
  const BlockGeometry geometry(s, strips);

  unsigned char* cursor = smem;
  auto take = [&](size_t bytes) {
    unsigned char* at = cursor;
    cursor += align128(bytes);
    return at;
  };
  const size_t tile = RL::tile_bytes(padded);
  T* qf = reinterpret_cast<T*>(take(tile));
  T* kf = reinterpret_cast<T*>(take(tile));
  T* vs = reinterpret_cast<T*>(take(tile));
  T* gs = reinterpret_cast<T*>(take(tile));
  float* gd = reinterpret_cast<float*>(take(padded * 4));
  float* inv_rms_q = reinterpret_cast<float*>(take(padded * 4));
  float* inv_rms_k = reinterpret_cast<float*>(take(padded * 4));
  float* mix = reinterpret_cast<float*>(take(blocks * blocks * 4));
  // dm per (key strip, query block): each written once, by the warp owning the key strip.
  float* dm_partials = reinterpret_cast<float*>(take(strips * blocks * 4));
  unsigned char* out_or_stages = take(RL::out_or_stages_bytes(padded));
  T* o_tile = reinterpret_cast<T*>(out_or_stages);
  float* stages = reinterpret_cast<float*>(out_or_stages);

  copy_rows<T, D>(p.q, b, h, n, padded, qf);
  copy_rows<T, D>(p.k, b, h, n, padded, kf);
  copy_rows<T, D>(p.v, b, h, n, padded, vs);
  copy_rows<T, D>(p.grad_out, b, h, n, padded, gs);
  copy_rows<T, D>(p.out, b, h, n, padded, o_tile);
  if (mixes) {
    for (int e = threadIdx.x; e < blocks * blocks; e += blockDim.x) mix[e] = p.mixing[e];
  }
  wait_async_copies();
  __syncthreads();
  features_in_place<T, D>(qf, n, padded, inv_rms_q);
  features_in_place<T, D>(kf, n, padded, inv_rms_k);
  scale_gradient_in_place<T, D>(p.den + static_cast<size_t>(bh) * n, n, padded, gs, o_tile, gd);
  __syncthreads();  // o_tile's space becomes the staging strips

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  float* stage = stages + warp * kStrip * RL::stage_ld;

  using Address = FragmentAddress<ld>;
  const Address lane_address(lane);
  const unsigned q_base = shared_address(qf), k_base = shared_address(kf),
                 v_base = shared_address(vs), g_base = shared_address(gs);

  // Keys: dv_s = sum_t P_ts g_t and dphi(k_s) = sum_t w_ts dP_ts phi(q_t), with
  // dP_ts = g_t . v_s + gd_t; dm_ij = sum over the tile pairs of dP_ts (phi(q_t) . phi(k_s)).
  for (int strip = warp; strip < strips; strip += kBackwardWarps) {
    const int key0 = strip * kStrip;
    uint32_t ka[D / 16][4];  // the strip's values are re-read per chunk: registers are short
#pragma unroll
    for (int kd = 0; kd < D / 16; ++kd)
      load_matrices(ka[kd], Address::region(k_base + lane_address.a, key0, 16 * kd));
    float dv[D / 8][4] = {}, dk[D / 8][4] = {};
    const int key_block = geometry.of(strip);
    float dm_partial = 0.f;
    int dm_block = 0;
    ChunkBlocks query_blocks(geometry.chunks_per_block);
    for (int chunk = 0; chunk < strips; ++chunk) {
      const int query0 = chunk * kStrip;
      float scores[2][4] = {}, dp[2][4] = {};  // [key][query]
#pragma unroll
      for (int kd = 0; kd < D / 16; ++kd) {
        uint32_t qb[4], gb[4], va[4];
        load_matrices(va, Address::region(v_base + lane_address.a, key0, 16 * kd));
        load_matrices(qb, Address::region(q_base + lane_address.b, query0, 16 * kd));
        mma<T>(scores[0], ka[kd], qb[0], qb[1]);
        mma<T>(scores[1], ka[kd], qb[2], qb[3]);
        load_matrices(gb, Address::region(g_base + lane_address.b, query0, 16 * kd));
        mma<T>(dp[0], va, gb[0], gb[1]);
        mma<T>(dp[1], va, gb[2], gb[3]);
      }
      float dm_tile = 0.f;
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const float2 gdv = *reinterpret_cast<const float2*>(gd + query0 + 8 * j + 2 * t);
        dp[j][0] += gdv.x, dp[j][1] += gdv.y, dp[j][2] += gdv.x, dp[j][3] += gdv.y;
#pragma unroll
        for (int e = 0; e < 4; ++e) dm_tile += scores[j][e] * dp[j][e];
      }
      float w = 1.f;
      if (mixes) {
        const int query_block = query_blocks.block;  // uniform over the warp
        if (query_block != dm_block) {
          const float total = warp_sum(dm_partial);
          if (lane == 0) dm_partials[strip * blocks + dm_block] = total;
          dm_block = query_block;
          dm_partial = 0.f;
        }
        dm_partial += dm_tile;
        w = mix[query_block * blocks + key_block];
      }
      query_blocks.next();
      uint32_t pa[4], da[4];
      to_operand<T>(pa, scores, w);
      to_operand<T>(da, dp, w);
#pragma unroll
      for (int dj = 0; dj < D / 16; ++dj) {
        uint32_t gb[4], qb[4];
        load_matrices_transposed(gb, Address::region(g_base + lane_address.a, query0, 16 * dj));
        mma<T>(dv[2 * dj], pa, gb[0], gb[1]);
        mma<T>(dv[2 * dj + 1], pa, gb[2], gb[3]);
        load_matrices_transposed(qb, Address::region(q_base + lane_address.a, query0, 16 * dj));
        mma<T>(dk[2 * dj], da, qb[0], qb[1]);
        mma<T>(dk[2 * dj + 1], da, qb[2], qb[3]);
      }
    }
    if (mixes) {
      const float total = warp_sum(dm_partial);
      if (lane == 0) dm_partials[strip * blocks + dm_block] = total;
    }
    __syncwarp();
    stage_strip<D>(stage, dv, lane);
    __syncwarp();
    store_strip<T, D>(stage, static_cast<T*>(p.grad_v), b, h, s.heads, n, key0, lane, nullptr,
                      nullptr);
    __syncwarp();
    stage_strip<D>(stage, dk, lane);
    __syncwarp();
    store_strip<T, D>(stage, static_cast<T*>(p.grad_k), b, h, s.heads, n, key0, lane, &p.k,
                      inv_rms_k);
    __syncwarp();
  }

  // Queries: dphi(q_t) = sum_s w_ts dP_ts phi(k_s).
  for (int strip = warp; strip < strips; strip += kBackwardWarps) {
    const int row0 = strip * kStrip;
    uint32_t ga[D / 16][4];
#pragma unroll
    for (int kd = 0; kd < D / 16; ++kd)
      load_matrices(ga[kd], Address::region(g_base + lane_address.a, row0, 16 * kd));
    const float gd_lo = gd[row0 + g], gd_hi = gd[row0 + g + 8];
    const float* mix_row = mixes ? mix + geometry.of(strip) * blocks : nullptr;
    float dq[D / 8][4] = {};
    ChunkBlocks key_blocks(geometry.chunks_per_block);
    for (int chunk = 0; chunk < strips; ++chunk) {
      const int key0 = chunk * kStrip;
      float dp[2][4] = {};  // [query][key]
#pragma unroll
      for (int kd = 0; kd < D / 16; ++kd) {
        uint32_t vb[4];
        load_matrices(vb, Address::region(v_base + lane_address.b, key0, 16 * kd));
        mma<T>(dp[0], ga[kd], vb[0], vb[1]);
        mma<T>(dp[1], ga[kd], vb[2], vb[3]);
      }
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        dp[j][0] += gd_lo, dp[j][1] += gd_lo, dp[j][2] += gd_hi, dp[j][3] += gd_hi;
      }
      uint32_t da[4];
      to_operand<T>(da, dp, mixes ? mix_row[key_blocks.block] : 1.f);
      key_blocks.next();
#pragma unroll
      for (int dj = 0; dj < D / 16; ++dj) {
        uint32_t kb[4];
        load_matrices_transposed(kb, Address::region(k_base + lane_address.a, key0, 16 * dj));
        mma<T>(dq[2 * dj], da, kb[0], kb[1]);
        mma<T>(dq[2 * dj + 1], da, kb[2], kb[3]);
      }
    }
    __syncwarp();
    stage_strip<D>(stage, dq, lane);
    __syncwarp();
    store_strip<T, D>(stage, static_cast<T*>(p.grad_q), b, h, s.heads, n, row0, lane, &p.q,
                      inv_rms_q);
    __syncwarp();
  }

  if (mixes) {
    __syncthreads();
    for (int e = threadIdx.x; e < blocks * blocks; e += blockDim.x) {
      const int query_block = e / blocks, key_block = e % blocks;
      const int first = key_block * geometry.chunks_per_block;
      const int last = min(strips, first + geometry.chunks_per_block);
      float total = 0.f;
      for (int strip = first; strip < last; ++strip)
        total += dm_partials[strip * blocks + query_block];
      if (total != 0.f) atomicAdd(p.grad_mixing + e, total);
    }
  }
}

int padded_tokens(const BlockLinearShape& s) {
  return (s.tokens + kStrip - 1) / kStrip * kStrip;
}

template <typename T, int D>
cudaError_t forward_for(const ResidentBlockLinearForward& a, cudaStream_t stream) {
  const auto& s = a.shape;
  const size_t bytes = ResidentLayout<D>::forward_bytes(padded_tokens(s), s.blocks);
  cudaError_t err =
      cudaFuncSetAttribute(resident_forward_kernel<T, D>,
                           cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
  if (err != cudaSuccess) return err;
  resident_forward_kernel<T, D><<<s.batch * s.heads, kForwardThreads, bytes, stream>>>(a);
  return cudaGetLastError();
}

template <typename T, int D>
cudaError_t backward_for(const ResidentBlockLinearBackward& a, cudaStream_t stream) {
  const auto& s = a.shape;
  cudaError_t err = cudaSuccess;
  if (a.mixing != nullptr &&
      (err = cudaMemsetAsync(a.grad_mixing, 0, sizeof(float) * s.blocks * s.blocks, stream)) !=
          cudaSuccess)
    return err;
  const size_t bytes = ResidentLayout<D>::backward_bytes(padded_tokens(s), s.blocks);
  err = cudaFuncSetAttribute(resident_backward_kernel<T, D>,
                             cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
  if (err != cudaSuccess) return err;
  resident_backward_kernel<T, D><<<s.batch * s.heads, kBackwardThreads, bytes, stream>>>(a);
  return cudaGetLastError();
}

template <typename Args>
using Run = cudaError_t (*)(const Args&, cudaStream_t);

template <typename Args, template <typename, int> class Pass>
Run<Args> pick(DType dtype, int head_dim) {
  const bool bf16 = dtype == DType::bf16;
  if (head_dim == 32) return bf16 ? &Pass<__nv_bfloat16, 32>::run : &Pass<__half, 32>::run;
  return bf16 ? &Pass<__nv_bfloat16, 64>::run : &Pass<__half, 64>::run;
}
template <typename T, int D>
struct ForwardPass {
  static cudaError_t run(const ResidentBlockLinearForward& a, cudaStream_t s) {
    return forward_for<T, D>(a, s);
  }
};
template <typename T, int D>
struct BackwardPass {
  static cudaError_t run(const ResidentBlockLinearBackward& a, cudaStream_t s) {
    return backward_for<T, D>(a, s);
  }
};

}  // namespace

bool resident_block_linear_supported(const BlockLinearShape& s, DType dtype) {
  if (dtype != DType::bf16 && dtype != DType::f16) return false;
  if (s.head_dim != 32 && s.head_dim != 64) return false;
  if (s.batch <= 0 || s.heads <= 0 || s.tokens <= 0 || s.blocks < 1 || s.blocks > 64) return false;
  if (static_cast<int64_t>(s.batch) * s.heads > 2147483647LL) return false;
  const int limit = s.head_dim == 32 ? max_tokens<32>() : max_tokens<64>();
  if (padded_tokens(s) > limit) return false;
  if (s.blocks > 1 && (s.tokens % s.blocks != 0 || (s.tokens / s.blocks) % kStrip != 0))
    return false;
  const size_t bytes = s.head_dim == 32
                           ? ResidentLayout<32>::backward_bytes(padded_tokens(s), s.blocks)
                           : ResidentLayout<64>::backward_bytes(padded_tokens(s), s.blocks);
  return bytes <= kResidentSmemLimit;
}

cudaError_t resident_block_linear_forward(const ResidentBlockLinearForward& args,
                                          cudaStream_t stream) {
  if (!resident_block_linear_supported(args.shape, args.dtype) || args.den == nullptr ||
      (args.mixing == nullptr && args.shape.blocks != 1))
    return cudaErrorInvalidValue;
  return pick<ResidentBlockLinearForward, ForwardPass>(args.dtype, args.shape.head_dim)(args,
                                                                                        stream);
}

cudaError_t resident_block_linear_backward(const ResidentBlockLinearBackward& args,
                                           cudaStream_t stream) {
  if (!resident_block_linear_supported(args.shape, args.dtype) || args.den == nullptr ||
      (args.mixing == nullptr && args.shape.blocks != 1) ||
      (args.mixing != nullptr && args.grad_mixing == nullptr))
    return cudaErrorInvalidValue;
  return pick<ResidentBlockLinearBackward, BackwardPass>(args.dtype, args.shape.head_dim)(args,
                                                                                          stream);
}

}  // namespace mhla_kernels
