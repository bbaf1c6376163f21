#pragma once
// What the resident kernels (resident_block_linear.cu, resident_state_backward.cu) share: one
// CTA per (batch, head) with the token rows in padded shared-memory tiles, 16-token warp strips,
// mma.sync m16n8k16 fragments through ldmatrix, and the tiles' preparation (copies, the feature
// map in place, the scaled output gradient) and the strips' way out (staging, feature backward).
#include <cstdint>
#include <type_traits>

#include "mhla/block_linear_attention.h"
#include "mhla/tiles.cuh"

namespace mhla_kernels {
namespace resident_tiles {

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
// `padded` are zero-filled. Complete after wait_async_copies() and a barrier. Threads is the
// CTA's size: each thread copies one 16-byte column of every (Threads / (D / 8))-th row.
template <typename T, int D, int Threads>
__device__ __forceinline__ void copy_rows(const TokenTensor& src, int b, int h, int n, int padded,
                                          T* tile) {
  constexpr int ld = ResidentLayout<D>::ld, per_row = D / 8;  // 16-byte pieces per row
  constexpr int rows_per_pass = Threads / per_row;
  constexpr int passes = (max_tokens<D>() + rows_per_pass - 1) / rows_per_pass;
  static_assert(Threads % per_row == 0, "whole rows per pass");
  const int first = static_cast<int>(threadIdx.x) / per_row;
  const int column = (static_cast<int>(threadIdx.x) % per_row) * 8;
  // The source advances by a 64-bit step that the compiler may not fold back into a product per
  // piece (it otherwise recomputes the whole address each time).
  uint64_t from = reinterpret_cast<uint64_t>(
      static_cast<const T*>(src.data) +
      (b * src.batch_stride + first * src.token_stride + h * src.head_stride + column));
  const uint64_t step = rows_per_pass * src.token_stride * sizeof(T);
  const unsigned to = shared_address(tile + first * ld + column);
  if (n == padded && first + (passes - 1) * rows_per_pass < padded) {
    // Every piece of this thread is live (a full tile, the vision shapes): a straight run of
    // copies, each a 64-bit step and a shared address with an immediate offset. The loop below
    // spent about 30 instructions a piece on branches and address set-up, a tenth of the state
    // backward's instructions, issued before anything else could start.
#pragma unroll
    for (int pass = 0; pass < passes; ++pass) {
      // 16 bytes global -> shared without passing through registers; many in flight.
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(
                       to + static_cast<unsigned>(pass * rows_per_pass * ld * sizeof(T))),
                   "l"(from));
      from += step;
      asm volatile("" : "+l"(from));
    }
    return;
  }
  unsigned at = to;
  const unsigned to_step = rows_per_pass * ld * sizeof(T);
#pragma unroll 4
  for (int r = first; r < padded; r += rows_per_pass, from += step, at += to_step) {
    if (r < n) {
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(at), "l"(from));
    } else {
      *reinterpret_cast<uint4*>(tile + r * ld + column) = make_uint4(0, 0, 0, 0);
    }
  }
}

// Two packed 16-bit lanes of T (__nv_bfloat162 or __half2).
template <typename T>
using Pair = std::conditional_t<std::is_same_v<T, __nv_bfloat16>, __nv_bfloat162, __half2>;

// phi(x) = relu(x / rms(x)) + floor of one thread's 16-byte piece of a row, in place (zero for a
// row that is not live), returning 1/rms. The sum of squares is fp32; the map itself runs on
// packed pairs: relu(x) * s + floor as two fused multiply-adds, s split into a 16-bit high and low
// part (s_lo * x + floor first, then s_hi * x + that, each rounded once), which gives the fp32
// result's rounding up to a rare last-bit tie, in 3 instructions per pair.
template <typename T, int Lanes>
__device__ __forceinline__ float features_of_piece(uint4& raw, bool live) {
  using P = Pair<T>;
  constexpr int D = Lanes * 8;
  const T* values = reinterpret_cast<const T*>(&raw);
  float squares = 0.f;
#pragma unroll
  for (int e = 0; e < 8; ++e) squares += to_float(values[e]) * to_float(values[e]);
  const float scale = rsqrtf(row_sum<Lanes>(squares) / D + kNormEps);
  if (!live) {
    raw = make_uint4(0, 0, 0, 0);
    return scale;
  }
  const T high = from_float<T>(scale), low = from_float<T>(scale - to_float(high));
  const P s_hi = P(high, high), s_lo = P(low, low),
          zero = P(from_float<T>(0.f), from_float<T>(0.f));
  const T floor_value = from_float<T>(kFeatureFloor);
  const P floor = P(floor_value, floor_value);
  P* pairs = reinterpret_cast<P*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const P positive = __hmax2(pairs[i], zero);
    pairs[i] = __hfma2(positive, s_hi, __hfma2(positive, s_lo, floor));
  }
  return scale;
}

// phi of every row of a shared tile, in place (padding rows become zero, not the floor); 1/rms
// per row into inv_rms when asked.
template <typename T, int D>
__device__ void features_in_place(T* tile, int n, int padded, float* inv_rms) {
  using L = Layout<T, D>;
  static_assert(L::vec == 8, "16-byte pieces of 8 elements");
  constexpr int ld = ResidentLayout<D>::ld;
  const int lane = threadIdx.x % L::lanes;
  for (int r = threadIdx.x / L::lanes; r < padded; r += blockDim.x / L::lanes) {  // whole warps
    uint4* at = reinterpret_cast<uint4*>(tile + r * ld + lane * L::vec);
    uint4 raw = *at;
    const float scale = features_of_piece<T, L::lanes>(raw, r < n);
    *at = raw;
    if (inv_rms != nullptr && lane == 0) inv_rms[r] = scale;
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

inline int padded_tokens(const BlockLinearShape& s) {
  return (s.tokens + kStrip - 1) / kStrip * kStrip;
}

}  // namespace resident_tiles
}  // namespace mhla_kernels
