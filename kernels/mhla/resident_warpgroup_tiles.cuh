#pragma once
// What the resident kernels on warpgroup products (resident_warpgroup_forward.cu and
// resident_warpgroup_backward.cu) share: one (batch, head) of N <= 256 tokens and head dim 64 per
// CTA of two warpgroups, its operands as 32 KiB tiles that the tensor copy engine fills, the
// feature map row by row, the mixing weights per 16 x 16 chunk pair, and stores of accumulator
// strips as whole rows.
#include <cuda.h>

#include <cstdlib>
#include <string>
#include <type_traits>
#include <utility>

#include "common/tensor_copy.cuh"
#include "common/tensor_map.h"
#include "common/warpgroup_mma.cuh"
#include "mhla/block_linear_attention.h"
#include "mhla/tiles.cuh"

namespace mhla_kernels {
namespace resident_warpgroup {

namespace wg = warpgroup;

constexpr int kD = 64;
constexpr int kTile = 64;        // tokens per warpgroup product (its M, N or depth; some take
                                 // 128 keys where N allows: wide_key_tiles)
constexpr int kChunk = 16;       // tokens per k16 step; blocks are whole chunks
constexpr int kMaxTokens = 256;  // one 32 KiB tile per operand
constexpr int kThreads = 256;    // two warpgroups
constexpr int kAcc = kTile / 2;  // accumulator floats per thread of a 64 x 64 product
constexpr int kWarps = kThreads / 32;

// All N <= 256 rows of one (batch, head) as the tensor copy engine writes them: whole 128-byte
// rows in the 128-byte swizzle. A tile has room for 256 rows; a copy writes the first N (rows
// past N are never read: N is a whole number of 64-row tiles).
template <typename T>
using Tile = wg::SwizzledTile<T, kMaxTokens>;
constexpr uint32_t kTileBytes = kMaxTokens * kD * 2;
// The bytes one copy of a pair's N rows brings (what its barrier expects). Why not whole
// 256-row boxes with rows past N read as zeros: at N = 64 the copy engine then wrote 24 KiB of
// zeros per tile, 72 KiB a pair in the forward, 120 KiB in the backward.
constexpr uint32_t pair_tile_bytes(int tokens) {
  return static_cast<uint32_t>(tokens) * kD * 2;
}
// The swizzle needs 1024-byte aligned tiles: the kernels ask for this much more shared memory
// and start their tiles at the first aligned byte.
constexpr size_t kTileAlignment = 1024;
__device__ __forceinline__ unsigned char* align_tiles(unsigned char* smem) {
  const uint32_t address = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  return smem + ((kTileAlignment - address % kTileAlignment) % kTileAlignment);
}

// One thread per row: the row's eight 16-byte pieces (a warp reads 32 consecutive rows: 512
// contiguous bytes per piece).
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

// max(x s + floor, floor) on a pair of 16-bit elements in one register, rounded once: s is split
// into a 16-bit head and tail (x s_tail + floor first, then x s_head added with one rounding), so
// the result is the 16-bit rounding of the fp32 value up to a 2^-16 relative term, in three packed
// instructions instead of six scalar ones and two conversions.
template <typename T>
__device__ __forceinline__ unsigned scaled_relu_pair(unsigned x, unsigned head, unsigned tail,
                                                     unsigned floor) {
  unsigned t, y;
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(t) : "r"(x), "r"(tail), "r"(floor));
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(y) : "r"(x), "r"(head), "r"(t));
    asm("max.bf16x2 %0, %1, %2;" : "=r"(y) : "r"(y), "r"(floor));
  } else {
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(t) : "r"(x), "r"(tail), "r"(floor));
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(y) : "r"(x), "r"(head), "r"(t));
    asm("max.f16x2 %0, %1, %2;" : "=r"(y) : "r"(y), "r"(floor));
  }
  return y;
}

// squares plus the sum of squares of a 16-byte piece's eight elements.
template <typename T>
__device__ __forceinline__ float add_squares(const uint4& piece, float squares) {
  const unsigned* words = reinterpret_cast<const unsigned*>(&piece);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float a, b;
    unpack_pair<T>(words[i], a, b);
    squares = fmaf(a, a, fmaf(b, b, squares));
  }
  return squares;
}
template <typename T, int Pieces>
__device__ __forceinline__ float sum_of_squares(const uint4 (&pieces)[Pieces]) {
  float squares = 0.f;
#pragma unroll
  for (int c = 0; c < Pieces; ++c) squares = add_squares<T>(pieces[c], squares);
  return squares;
}

// The feature map's scale 1 / rms of a row as scaled_relu_pair's packed constants.
struct FeatureScale {
  unsigned head, tail, floor;
  template <typename T>
  __device__ __forceinline__ static FeatureScale of(float scale) {
    float head_value, tail_value;
    unpack_pair<T>(pack_pair<T>(scale, scale), head_value, tail_value);
    return {pack_pair<T>(head_value, head_value),
            pack_pair<T>(scale - head_value, scale - head_value),
            pack_pair<T>(tiles::kFeatureFloor, tiles::kFeatureFloor)};
  }
};

// Row r of phi = relu(x / rms(x)) + floor for row r of x (in place when raw and tile are the
// same); returns 1 / rms.
template <typename T>
__device__ __forceinline__ float features_of_row(Tile<T> raw, Tile<T> tile, int r) {
  uint4 pieces[kD / 8];
  float squares = 0.f;
#pragma unroll
  for (int c = 0; c < kD / 8; ++c) {
    pieces[c] = *reinterpret_cast<const uint4*>(raw.at(r, 8 * c));
    squares = add_squares<T>(pieces[c], squares);
  }
  const float scale = rsqrtf(squares / kD + tiles::kNormEps);
  const auto f = FeatureScale::of<T>(scale);
#pragma unroll
  for (int c = 0; c < kD / 8; ++c) {
    unsigned* words = reinterpret_cast<unsigned*>(&pieces[c]);
#pragma unroll
    for (int i = 0; i < 4; ++i) words[i] = scaled_relu_pair<T>(words[i], f.head, f.tail, f.floor);
    *reinterpret_cast<uint4*>(tile.at(r, 8 * c)) = pieces[c];
  }
  return scale;
}

// Keeps the register operands of an asynchronous product alive (and unchanged) until its wait.
template <int KBlocks>
__device__ __forceinline__ void pin_fragments(unsigned (&a)[KBlocks][4]) {
#pragma unroll
  for (int kb = 0; kb < KBlocks; ++kb)
#pragma unroll
    for (int i = 0; i < 4; ++i) asm volatile("" : "+r"(a[kb][i])::"memory");
}

// A warp's staging strip: 16 rows of 64 elements in the 128-byte swizzle (the 4-byte writes of
// the accumulator layout, eight rows by four lanes, land in 32 different banks), 1024-byte
// aligned, stored by the copy engine through a 16-row box of a swizzled token map.
template <typename T>
using Strip = wg::SwizzledTile<T, 16>;
constexpr uint32_t kStripBytes = 16 * kD * 2;
constexpr int kStripRows = 16;

// Stores a warp's 16-row strip of an accumulator (rows strip0 .. strip0 + 15 of pair (b, h)'s
// output, `map` a swizzled map with 16-row boxes): written into the warp's staging strip once the
// copy engine has read the previous one, then one asynchronous store by lane 0 (fewer
// instructions than the lanes' own 128-byte row stores; in session 38's call 5 about as fast: 1 us
// less in the forward, 1 us more in the backward). The last store must be waited for
// (finish_strip_stores) before the kernel ends.
template <typename T>
__device__ __forceinline__ void store_strip(const CUtensorMap* map, int b, int h, int strip0,
                                            Strip<T> stage, const float (&acc)[kAcc]) {
  const int lane = threadIdx.x % 32, c0 = 2 * (lane % 4), r = lane / 4;
  if (lane == 0) tensor_copy::wait_stores_read();
  __syncwarp();
#pragma unroll
  for (int j = 0; j < kAcc / 4; ++j) {
    *reinterpret_cast<unsigned*>(stage.at(r, c0 + 8 * j)) =
        pack_pair<T>(acc[4 * j], acc[4 * j + 1]);
    *reinterpret_cast<unsigned*>(stage.at(r + 8, c0 + 8 * j)) =
        pack_pair<T>(acc[4 * j + 2], acc[4 * j + 3]);
  }
  tensor_copy::fence_for_copy_engine();
  __syncwarp();
  if (lane == 0) tensor_copy::store_swizzled_token_rows(map, stage.p, strip0, h, b);
}
__device__ __forceinline__ void finish_strip_stores() {
  if (threadIdx.x % 32 == 0) tensor_copy::wait_stores_done();
}

// The tensor map of a contiguous [B, N, H, 64] output, 16-row boxes (store_strip).
inline cudaError_t encode_output_strips(CUtensorMap* map, void* data, const BlockLinearShape& s) {
  const int64_t token_stride = static_cast<int64_t>(s.heads) * kD;
  return encode_swizzled_token_view_map(map, data, s.batch, s.tokens, s.heads,
                                        token_stride * s.tokens, token_stride, kD, kStripRows);
}

// Zeroes an accumulator that products will add into; the pin keeps the zeroing ahead of the
// first product (otherwise the compiler may sink it into the asynchronous products' stage and
// then serialize every wgmma).
template <int R>
__device__ __forceinline__ void zero_accumulator(float (&acc)[R]) {
#pragma unroll
  for (int i = 0; i < R; ++i) acc[i] = 0.f;
  wg::pin(acc);
}

// Calls f(std::integral_constant<int, i>) for i = 0 .. Count - 1, unrolled: register arrays
// indexed by i stay registers, and no product sits under a branch.
template <typename F, int... I>
__device__ __forceinline__ void static_for_each(F&& f, std::integer_sequence<int, I...>) {
  (f(std::integral_constant<int, I>{}), ...);
}
template <int Count, typename F>
__device__ __forceinline__ void static_for(F&& f) {
  static_for_each(f, std::make_integer_sequence<int, Count>{});
}

// A sweep over Count tiles of the other side in which the products that consume tile t run while
// the elementwise work of tile t + 1 is done: issue(t + 1) is committed ahead of products(t), so
// work(t + 1) waits only for the former and leaves products(t)'s ProductGroups commit groups in
// flight (groups complete in order). work(step) and products(step) take the tile as an
// std::integral_constant and use register buffer (t % 2): the fragments products(t) reads stay
// untouched until work(t + 2). The caller issues tile 0 before and waits for all after.
template <int Count, int ProductGroups, typename Work, typename Products, typename Issue>
__device__ __forceinline__ void pipelined_sweep(Work&& work, Products&& products, Issue&& issue) {
  static_for<Count>([&](auto step) {
    constexpr int t = decltype(step)::value;
    if constexpr (t == 0) {
      wg::wait<0>();
    } else {
      wg::wait<ProductGroups>();
    }
    work(step);
    wg::fence();
    if constexpr (t + 1 < Count) issue(t + 1);
    products(step);
  });
}

// The weights of the Chunks 16-token chunks of tile `tile` (16 Chunks tokens wide) in a row of a
// weight table.
template <int Chunks = 4>
__device__ __forceinline__ void tile_weights(float (&w)[Chunks], const float* table_row, int tile) {
#pragma unroll
  for (int c = 0; c < Chunks; c += 4) {
    const float4 w4 = *reinterpret_cast<const float4*>(table_row + Chunks * tile + c);
    w[c] = w4.x, w[c + 1] = w4.y, w[c + 2] = w4.z, w[c + 3] = w4.w;
  }
}

// The mixing weight of every (query chunk, key chunk) pair, in both orders, so that a warp reads
// the four weights of a 64-token tile with one 16-byte load (no divisions in the sweeps);
// by_key may be null.
__device__ __forceinline__ void fill_weight_tables(const float* mixing, int chunks, int blocks,
                                                   float* by_query, float* by_key) {
  const int block_chunks = chunks / blocks;
  for (int e = threadIdx.x; e < chunks * chunks; e += blockDim.x) {
    const int qc = e / chunks, kc = e % chunks;
    const float w =
        mixing != nullptr ? mixing[(qc / block_chunks) * blocks + kc / block_chunks] : 1.f;
    by_query[e] = w;
    if (by_key != nullptr) by_key[kc * chunks + qc] = w;
  }
}

// The shapes these kernels take: bf16 or fp16, head dim 64, N a multiple of 64 up to 256, blocks
// of whole 16-token chunks.
inline bool shape_supported(const BlockLinearShape& s, DType dtype) {
  if (dtype != DType::bf16 && dtype != DType::f16) return false;
  if (s.head_dim != kD || s.tokens <= 0 || s.tokens > kMaxTokens || s.tokens % kTile != 0)
    return false;
  if (s.batch <= 0 || s.heads <= 0 || static_cast<int64_t>(s.batch) * s.heads > 2147483647LL)
    return false;
  return s.blocks >= 1 && s.tokens % s.blocks == 0 && (s.tokens / s.blocks) % kChunk == 0;
}

// Whether the products over keys take 128 keys at a time where N is a multiple of 128 (fewer
// waits, less shared memory read per flop); MHLA_WARPGROUP_KEY_TILE=64 keeps 64 (A/B runs).
inline bool wide_key_tiles(int tokens) {
  static const bool narrow = [] {
    const char* value = std::getenv("MHLA_WARPGROUP_KEY_TILE");
    return value != nullptr && std::string(value) == "64";
  }();
  return tokens % 128 == 0 && !narrow;
}

// Calls launch(tiles, key_tile) with N / 64 and the dq sweep's key tile (wide_key_tiles) as
// std::integral_constant, for the N that shape_supported takes: the sweeps are unrolled per N.
template <typename Launch>
inline cudaError_t dispatch_tiles(int tokens, Launch&& launch) {
  using One = std::integral_constant<int, 1>;
  using Two = std::integral_constant<int, 2>;
  using Three = std::integral_constant<int, 3>;
  using Four = std::integral_constant<int, 4>;
  using Narrow = std::integral_constant<int, kTile>;
  using Wide = std::integral_constant<int, 2 * kTile>;
  const bool wide = wide_key_tiles(tokens);
  switch (tokens / kTile) {
    case 1:
      return launch(One{}, Narrow{});
    case 2:
      return wide ? launch(Two{}, Wide{}) : launch(Two{}, Narrow{});
    case 3:
      return launch(Three{}, Narrow{});
    case 4:
      return wide ? launch(Four{}, Wide{}) : launch(Four{}, Narrow{});
    default:
      return cudaErrorInvalidValue;
  }
}

// An output the copy engine can write: a 16-byte aligned base (contiguous rows of 64 elements).
inline bool storable(const void* data) {
  return reinterpret_cast<uintptr_t>(data) % 16 == 0;
}

// A view the tensor copy engine can read: 16-byte aligned base and strides.
inline bool copyable(const TokenTensor& t) {
  return reinterpret_cast<uintptr_t>(t.data) % 16 == 0 && (t.batch_stride * 2) % 16 == 0 &&
         (t.token_stride * 2) % 16 == 0 && (t.head_stride * 2) % 16 == 0;
}

// Its tensor map: one box = the N rows of one (batch, head) (pair_tile_bytes).
inline cudaError_t encode_rows(CUtensorMap* map, const TokenTensor& t, const BlockLinearShape& s) {
  return encode_swizzled_token_view_map(map, t.data, s.batch, s.tokens, s.heads, t.batch_stride,
                                        t.token_stride, t.head_stride, s.tokens);
}
// One thread starts the copy of pair (b, h)'s rows of `map` into `tile`, completing on `bar`.
template <typename T>
__device__ __forceinline__ void copy_pair_rows(Tile<T> tile, const CUtensorMap* map, int b, int h,
                                               uint64_t* bar) {
  tensor_copy::copy_swizzled_token_rows(tile.p, map, 0, h, b, bar);
}

}  // namespace resident_warpgroup
}  // namespace mhla_kernels
