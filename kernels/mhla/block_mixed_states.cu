// Bidirectional MHLA's block states and their mix in one pass (see block_mixed_states.h).
//
// One CTA of four warps per (batch*head, slice of `width` value columns). It walks the
// sequence's 64-token tiles in order through a ring of cp.async stages; each tile's key rows
// become phi(K) in place, and each warp adds phi(K)^T V for its 16 x 16 corner of the state
// (ldmatrix + mma.sync). When a block's last tile is done the warp writes its corner of S_j and
// adds m_ij times it into its corner of every mixed state S'_i, which stay in registers until
// the end. Slice 0 also sums phi(k) (a product with a matrix of ones) for z_j and z'_i.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdlib>

#include "common/async_copy.cuh"
#include "common/wmma_gemm.cuh"
#include "mhla/block_mixed_states.h"
#include "mhla/tiles.cuh"

namespace mhla_kernels {
namespace {

using wmma_tiles::TileAccumulator;
namespace mma = wmma_tiles::detail;

constexpr int kThreads = 128;  // four warps
constexpr int kStages = 4;     // tiles in flight: three loading while one is used
constexpr int kRows = 64;      // tokens per tile
constexpr int kMaxBlocks = kMixedStatesMaxBlocks;

// How one head dimension splits over the four warps: each warp owns a 16 x 16 corner of every
// state (16 key features by 16 value columns); a CTA covers all D rows and `width` columns.
template <int D>
struct Slices {
  static constexpr int row_tiles = D / 16;
  static constexpr int column_groups = 4 / row_tiles;
  static constexpr int width = 16 * column_groups;
  static constexpr int count = D / width;
  static constexpr int ldk = D + 8;  // padded rows: ldmatrix without bank conflicts
  static constexpr int ldv = width + 8;
  static constexpr int k_stage = kRows * ldk;  // elements
  static constexpr int v_stage = kRows * ldv;
  static constexpr int state = D * D + D;
};

template <typename E, int D>
constexpr size_t smem_bytes() {
  using S = Slices<D>;
  return kStages * (S::k_stage + S::v_stage) * sizeof(E) + kMaxBlocks * D * 4 +
         kMaxBlocks * kMaxBlocks * 4;
}

template <typename E>
constexpr unsigned kOnes = std::is_same_v<E, __nv_bfloat16> ? 0x3F803F80u : 0x3C003C00u;

// phi(x) = relu(x / rms(x)) + floor in place for the tile's rows r < valid (the rest stay the
// zeros the copies filled in). Two threads per row, D / 2 elements each.
template <typename E, int D>
__device__ __forceinline__ void features_in_place(E* tile, int valid) {
  using S = Slices<D>;
  constexpr int kHalf = D / 2, kWords = kHalf / 8;
  const int r = threadIdx.x / 2, half = threadIdx.x % 2;
  uint4* row = reinterpret_cast<uint4*>(tile + r * S::ldk + half * kHalf);
  uint4 raw[kWords];
  float squares = 0.f;
#pragma unroll
  for (int w = 0; w < kWords; ++w) {
    raw[w] = row[w];
    const E* x = reinterpret_cast<const E*>(&raw[w]);
#pragma unroll
    for (int i = 0; i < 8; ++i) squares += to_float(x[i]) * to_float(x[i]);
  }
  squares += __shfl_xor_sync(0xffffffffu, squares, 1);
  if (r >= valid) return;
  const float scale = rsqrtf(squares / D + tiles::kNormEps);
#pragma unroll
  for (int w = 0; w < kWords; ++w) {
    E* x = reinterpret_cast<E*>(&raw[w]);
#pragma unroll
    for (int i = 0; i < 8; ++i)
      x[i] = from_float<E>(fmaxf(to_float(x[i]) * scale, 0.f) + tiles::kFeatureFloor);
    row[w] = raw[w];
  }
}

// MinCtas: CTAs per multiprocessor the registers are capped for (3: 168 registers and a few
// spills; 2: no spills). MHLA_MIXED_STATES_CTAS picks one for A/B runs.
template <typename T, int D, int MinCtas>
__global__ void __launch_bounds__(kThreads, MinCtas) mixed_states_kernel(BlockMixedStates p) {
  using S = Slices<D>;
  using E = typename wmma_tiles::Mma<T>::elem;
  extern __shared__ __align__(128) unsigned char smem[];
  E* k_tiles = reinterpret_cast<E*>(smem);
  E* v_tiles = k_tiles + kStages * S::k_stage;
  float* z_blocks = reinterpret_cast<float*>(v_tiles + kStages * S::v_stage);  // [blocks][D]
  float* weights = z_blocks + kMaxBlocks * D;  // [16][16], zero outside the matrix

  const int blocks = p.shape.blocks, slice = blockIdx.x, bh = blockIdx.y;
  const int b = bh / p.shape.heads, h = bh % p.shape.heads;
  const int length = p.shape.tokens / blocks;
  const int tiles_per_block = (length + kRows - 1) / kRows, tile_count = blocks * tiles_per_block;
  const int column0 = slice * S::width;
  for (int e = threadIdx.x; e < kMaxBlocks * kMaxBlocks; e += kThreads) {
    const int i = e / kMaxBlocks, j = e % kMaxBlocks;
    weights[e] = i < blocks && j < blocks ? p.mixing[i * blocks + j] : 0.f;
  }
  const T* k_rows = static_cast<const T*>(p.k.data) + b * p.k.batch_stride + h * p.k.head_stride;
  const T* v_rows =
      static_cast<const T*>(p.v.data) + b * p.v.batch_stride + h * p.v.head_stride + column0;
  auto tile_rows = [&](int g, int& n0, int& valid) {
    const int j = g / tiles_per_block, t = g % tiles_per_block;
    n0 = j * length + t * kRows;
    valid = min(kRows, length - t * kRows);
  };
  // Tile g's key rows and value columns into stage g % kStages (rows past the block zero).
  auto issue = [&](int g) {
    if (g < tile_count) {
      int n0, valid;
      tile_rows(g, n0, valid);
      E* kd = k_tiles + (g % kStages) * S::k_stage;
      E* vd = v_tiles + (g % kStages) * S::v_stage;
      constexpr int kChunks = D / 8, vChunks = S::width / 8;  // 16-byte copies per row
#pragma unroll
      for (int c = threadIdx.x; c < kRows * kChunks; c += kThreads) {
        const int r = c / kChunks, x = c % kChunks;
        const T* src = k_rows + static_cast<int64_t>(n0 + (r < valid ? r : 0)) * p.k.token_stride;
        async_copy::copy<16>(kd + r * S::ldk + x * 8, src + x * 8, r < valid);
      }
#pragma unroll
      for (int c = threadIdx.x; c < kRows * vChunks; c += kThreads) {
        const int r = c / vChunks, x = c % vChunks;
        const T* src = v_rows + static_cast<int64_t>(n0 + (r < valid ? r : 0)) * p.v.token_stride;
        async_copy::copy<16>(vd + r * S::ldv + x * 8, src + x * 8, r < valid);
      }
    }
    async_copy::commit();
  };

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, quad = lane / 8, row8 = lane % 8;
  const int row_tile = warp % S::row_tiles, group = warp / S::row_tiles;
  const bool sums_z = slice == 0 && group == 0;  // warp-uniform
  // Row addresses of the four 8 x 8 matrices of each ldmatrix (wmma_tiles::mma_tile's layout):
  // A = phi(K)^T stored [token][feature], B = V stored [token][column].
  const int a_offset = ((quad / 2) * 8 + row8) * S::ldk + row_tile * 16 + (quad % 2) * 8;
  const int b_offset = ((quad % 2) * 8 + row8) * S::ldv + group * 16 + (quad / 2) * 8;

  TileAccumulator acc, mixed[kMaxBlocks];
  acc.zero();
#pragma unroll
  for (int i = 0; i < kMaxBlocks; ++i) mixed[i].zero();
  float z_acc[4] = {0.f, 0.f, 0.f, 0.f};

#pragma unroll
  for (int g = 0; g < kStages - 1; ++g) issue(g);
  for (int g = 0; g < tile_count; ++g) {
    async_copy::wait<kStages - 2>();
    __syncthreads();  // tile g is in; every warp is done with tile g - 1's stage
    issue(g + kStages - 1);
    int n0, valid;
    tile_rows(g, n0, valid);
    E* kf = k_tiles + (g % kStages) * S::k_stage;
    const E* vs = v_tiles + (g % kStages) * S::v_stage;
    features_in_place<E, D>(kf, valid);
    __syncthreads();
    const int rows = (valid + 15) / 16 * 16;
    for (int kk = 0; kk < rows; kk += 16) {
      unsigned fa[4], fb[4];
      mma::load_matrices<true>(fa, kf + a_offset + kk * S::ldk);
      mma::load_matrices<true>(fb, vs + b_offset + kk * S::ldv);
      mma::mma16816<E>(acc.x[0], fa, fb[0], fb[1]);
      mma::mma16816<E>(acc.x[1], fa, fb[2], fb[3]);
      if (sums_z) mma::mma16816<E>(z_acc, fa, kOnes<E>, kOnes<E>);
    }
    if (g % tiles_per_block != tiles_per_block - 1) continue;
    // Block j is complete: its state, and its share of every mixed state.
    const int j = g / tiles_per_block;
    float* state = p.states + (static_cast<size_t>(bh) * blocks + j) * S::state;
    acc.store(state + row_tile * 16 * D + column0 + group * 16, D);
    if (sums_z) {
      if (lane % 4 == 0) {
        const int d = row_tile * 16 + lane / 4;
        z_blocks[j * D + d] = z_acc[0];
        z_blocks[j * D + d + 8] = z_acc[2];
        state[D * D + d] = z_acc[0];
        state[D * D + d + 8] = z_acc[2];
      }
#pragma unroll
      for (int e = 0; e < 4; ++e) z_acc[e] = 0.f;
    }
#pragma unroll
    for (int i = 0; i < kMaxBlocks; ++i) {
      const float w = weights[i * kMaxBlocks + j];
#pragma unroll
      for (int half = 0; half < 2; ++half) {
#pragma unroll
        for (int e = 0; e < 4; ++e) mixed[i].x[half][e] += w * acc.x[half][e];
      }
    }
    acc.zero();
  }
#pragma unroll
  for (int i = 0; i < kMaxBlocks; ++i) {
    if (i < blocks) {
      mixed[i].store(p.mixed + (static_cast<size_t>(bh) * blocks + i) * S::state +
                         row_tile * 16 * D + column0 + group * 16,
                     D);
    }
  }
  if (slice != 0) return;  // CTA-uniform
  __syncthreads();         // z_blocks complete
  for (int e = threadIdx.x; e < blocks * D; e += kThreads) {
    const int i = e / D, d = e % D;
    float sum = 0.f;
    for (int j = 0; j < blocks; ++j) sum += weights[i * kMaxBlocks + j] * z_blocks[j * D + d];
    p.mixed[(static_cast<size_t>(bh) * blocks + i) * S::state + D * D + d] = sum;
  }
}

template <typename T, int D, int MinCtas>
cudaError_t launch_capped(const BlockMixedStates& a, cudaStream_t stream) {
  using E = typename wmma_tiles::Mma<T>::elem;
  constexpr size_t bytes = smem_bytes<E, D>();
  static const cudaError_t opted = tiles::allow_smem(mixed_states_kernel<T, D, MinCtas>, bytes);
  if (opted != cudaSuccess) return opted;
  const dim3 grid(Slices<D>::count, a.shape.batch * a.shape.heads);
  mixed_states_kernel<T, D, MinCtas><<<grid, kThreads, bytes, stream>>>(a);
  return cudaGetLastError();
}

template <typename T, int D>
cudaError_t launch(const BlockMixedStates& a, cudaStream_t stream) {
  static const bool three = [] {
    const char* value = std::getenv("MHLA_MIXED_STATES_CTAS");
    return value != nullptr && value[0] == '3';
  }();
  return three ? launch_capped<T, D, 3>(a, stream) : launch_capped<T, D, 2>(a, stream);
}

}  // namespace

bool block_mixed_states_supported(const BlockLinearShape& s, DType dtype) {
  return (dtype == DType::bf16 || dtype == DType::f16) && (s.head_dim == 32 || s.head_dim == 64) &&
         s.batch > 0 && s.heads > 0 && s.blocks >= 1 && s.blocks <= kMixedStatesMaxBlocks &&
         s.tokens >= s.blocks && s.tokens % s.blocks == 0 &&
         static_cast<int64_t>(s.batch) * s.heads <= 65535;
}

int block_mixed_states_ctas(const BlockLinearShape& s) {
  const int slices = s.head_dim == 64 ? Slices<64>::count : Slices<32>::count;
  return slices * s.batch * s.heads;
}

cudaError_t block_mixed_states(const BlockMixedStates& a, cudaStream_t stream) {
  if (!block_mixed_states_supported(a.shape, a.dtype) || a.mixing == nullptr ||
      a.states == nullptr || a.mixed == nullptr || a.k.data == nullptr || a.v.data == nullptr)
    return cudaErrorInvalidValue;
  const bool bf16 = a.dtype == DType::bf16;
  if (a.shape.head_dim == 64)
    return bf16 ? launch<__nv_bfloat16, 64>(a, stream) : launch<__half, 64>(a, stream);
  return bf16 ? launch<__nv_bfloat16, 32>(a, stream) : launch<__half, 32>(a, stream);
}

}  // namespace mhla_kernels
