// The short-sequence forward on warpgroup products: see resident_warpgroup_forward.h. With three
// or four query tiles each has a warpgroup of its own (64-key products, at most 128 registers a
// thread at four: session 47 measured 74.0 -> 71.9 us at N = 256 against two warpgroups of
// 128-key products, whose turns at the tensor cores left more of them idle); with one or two,
// two warpgroups own the tiles w, w + 2. The scores of the next key tile are issued ahead of the
// product that takes this tile's, which then runs while the next tile's elementwise work is done
// (pipelined_sweep, the pattern of the backward's sweeps). MHLA_WARPGROUP_FORWARD_GROUPS=2 keeps
// two warpgroups at every N (A/B runs).
#include "common/device_info.h"
#include "common/tensor_copy.cuh"
#include "mhla/resident_warpgroup_forward.h"
#include "mhla/resident_warpgroup_tiles.cuh"

namespace mhla_kernels {
namespace {

using namespace resident_warpgroup;
namespace tc = tensor_copy;

// Tile sets of q, k and v, each N rows: one computed while the others fill. Two at N = 192 and
// 256 (all that fits); four where N <= 128, whose short pairs otherwise wait longer for their
// copies (Nsight per launch, session 49: N = 64 77.0 -> 75.0 us, N = 128 59.7 -> 56.7 us).
constexpr int tile_sets(int tiles) {
  return tiles <= 2 ? 4 : 2;
}

struct SmemPlan {
  size_t tile, chunk_pairs, stage;
  int sets;
  __host__ __device__ SmemPlan(int n, int warps)
      : tile(pair_tile_bytes(n)),
        chunk_pairs(tiles::align128(static_cast<size_t>(n / kChunk) * (n / kChunk) * 4)),
        stage(static_cast<size_t>(warps) * kStripBytes),
        sets(tile_sets(n / kTile)) {}
  __host__ __device__ size_t tiles_bytes() const { return sets * 3 * tile; }
  // The tile sets; staging strips; the weight table; per set a barrier for q and k and one for v.
  __host__ __device__ size_t bytes() const {
    return kTileAlignment + tiles_bytes() + chunk_pairs + stage + 128;
  }
};

// The inputs' maps (one box = all N rows of one (batch, head)) and the output's (one box = a
// warp's 16-row strip).
struct InputMaps {
  CUtensorMap q, k, v, out;
};

// Set i holds q, k and v, one tile of `tile` bytes each, from 3 i tiles into the shared memory.
template <typename T>
struct TileSet {
  Tile<T> q, k, v;
  __device__ TileSet(unsigned char* base, int i, uint32_t tile)
      : q{reinterpret_cast<T*>(base + (3 * i) * tile)},
        k{reinterpret_cast<T*>(base + (3 * i + 1) * tile)},
        v{reinterpret_cast<T*>(base + (3 * i + 2) * tile)} {}
};

// Tiles: N / 64; KeyTile: keys per scores product (64, or 128 when N is a multiple of 128: wider
// products read less shared memory per flop and halve the waits); Groups: warpgroups, each owning
// the query tiles group, group + Groups, ...
template <typename T, int Tiles, int KeyTile, int Groups>
__global__ void __launch_bounds__(Groups * 128, 1)
    resident_warpgroup_forward_kernel(ResidentBlockLinearForward p,
                                      const __grid_constant__ InputMaps maps) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  unsigned char* const smem = align_tiles(smem_raw);
  const auto& s = p.shape;
  constexpr int n = Tiles * kTile, tile_count = Tiles, chunks = n / kChunk;
  const int blocks = p.mixing != nullptr ? s.blocks : 1;
  constexpr int threads = Groups * 128;
  const SmemPlan plan(n, threads / 32);
  constexpr int kSets = tile_sets(Tiles);
  constexpr uint32_t tile_bytes = pair_tile_bytes(n);
  tiles::Carver carve{smem + plan.tiles_bytes()};
  T* stage = carve.take<T>(plan.stage);  // 1024-byte aligned: it follows whole tiles
  float* weight_by_query = carve.take<float>(plan.chunk_pairs);  // [query chunk][key chunk]
  uint64_t* arrived = carve.take<uint64_t>(128);                 // [set]: q and k; [kSets + set]: v

  const int group = threadIdx.x / 128, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  const Strip<T> strip_stage{stage + (threadIdx.x / 32) * kStripRows * kD};
  fill_weight_tables(p.mixing, chunks, blocks, weight_by_query, nullptr);

  const int pairs = s.batch * s.heads;
  const int stride = gridDim.x;
  // One thread starts the copies of pair bh into set `set`: q and k on one barrier, v, which only
  // the products read, on another, so the feature map can start before v is in.
  auto issue = [&](int bh, int set) {
    const int b = bh / s.heads, h = bh % s.heads;
    const TileSet<T> into(smem, set, tile_bytes);
    tc::arrive_expecting(arrived + set, 2 * tile_bytes);
    copy_pair_rows(into.q, &maps.q, b, h, arrived + set);
    copy_pair_rows(into.k, &maps.k, b, h, arrived + set);
    tc::arrive_expecting(arrived + kSets + set, tile_bytes);
    copy_pair_rows(into.v, &maps.v, b, h, arrived + kSets + set);
  };
  if (threadIdx.x == 0) {
    for (int i = 0; i < 2 * kSets; ++i) tc::init(arrived + i);
    tc::fence_init();
    if constexpr (kSets == 2) {
      if (blockIdx.x < pairs) issue(blockIdx.x, 0);
    } else {
      for (int ahead = 0; ahead + 1 < kSets; ++ahead) {
        const int bh = blockIdx.x + ahead * stride;
        if (bh < pairs) issue(bh, ahead);
      }
    }
  }
  __syncthreads();

  int set = 0;
  uint32_t parities = 0;  // bit i: the phase of set i's barrier to wait for
  for (int bh = blockIdx.x; bh < pairs; bh += stride) {
    const int b = bh / s.heads, h = bh % s.heads;
    // The set the last pair used was released at its end: the pair kSets - 1 ahead starts into
    // it.
    const int refill = kSets == 2 ? set ^ 1 : (set == 0 ? kSets - 1 : set - 1);
    if (threadIdx.x == 0 && bh + (kSets - 1) * stride < pairs)
      issue(bh + (kSets - 1) * stride, refill);
    const TileSet<T> tiles_now(smem, set, tile_bytes);
    const uint32_t parity = (parities >> set) & 1;
    parities ^= 1u << set;
    tc::wait(arrived + set, parity);
    // Rows 0 .. n - 1 of q, then of k.
    for (int row = threadIdx.x; row < 2 * n; row += threads) {
      const Tile<T> tile = row < n ? tiles_now.q : tiles_now.k;
      const int r = row < n ? row : row - n;
      features_of_row(tile, tile, r);
    }
    tc::wait(arrived + kSets + set, parity);
    wg::fence_shared_for_mma();
    __syncthreads();

    for (int qt = group; qt < tile_count; qt += Groups) {
      const int query0 = qt * kTile, strip0 = query0 + 16 * warp;
      const int query_chunk = qt * (kTile / kChunk) + warp;
      const int row0 = strip0 + lane / 4;
      constexpr int kKeyChunks = KeyTile / kChunk;
      constexpr int key_tiles = n / KeyTile;
      float out[kAcc], scores[KeyTile / 2];
      unsigned pa[2][kKeyChunks][4];  // the product of one key tile runs while the next is made
      float den_lo = 0.f, den_hi = 0.f;
      zero_accumulator(out);
      wg::fence();
      wg::product<T, KeyTile, kD>(scores, tiles_now.q, query0, 0, tiles_now.k, 0, 0, false);
      auto work = [&](auto step) {
        constexpr int kt = decltype(step)::value, set = kt % 2;
        pin_fragments(pa[set]);
        float w[kKeyChunks];
        tile_weights<kKeyChunks>(w, weight_by_query + query_chunk * chunks, kt);
#pragma unroll
        for (int jj = 0; jj < kKeyChunks; ++jj) {
          const float* a = scores + 8 * jj;
          den_lo += w[jj] * (a[0] + a[1] + a[4] + a[5]);
          den_hi += w[jj] * (a[2] + a[3] + a[6] + a[7]);
#pragma unroll
          for (int r = 0; r < 4; ++r)
            pa[set][jj][r] = pack_pair<T>(a[2 * r] * w[jj], a[2 * r + 1] * w[jj]);
        }
      };
      auto products = [&](auto step) {
        constexpr int kt = decltype(step)::value;
        wg::product_register_a<T, kD, KeyTile>(out, pa[kt % 2], tiles_now.v, kt * KeyTile, 0, true);
      };
      pipelined_sweep<key_tiles, 1>(work, products, [&](int kt) {
        wg::product<T, KeyTile, kD>(scores, tiles_now.q, query0, 0, tiles_now.k, kt * KeyTile, 0,
                                    false);
      });
      // The four lanes of a quad hold a row between them.
#pragma unroll
      for (int offset = 1; offset < 4; offset *= 2) {
        den_lo += __shfl_xor_sync(0xffffffffu, den_lo, offset);
        den_hi += __shfl_xor_sync(0xffffffffu, den_hi, offset);
      }
      wg::wait<0>();
      pin_fragments(pa[0]);
      pin_fragments(pa[1]);
      const float scale_lo = 1.f / (den_lo + tiles::kDenominatorEps);
      const float scale_hi = 1.f / (den_hi + tiles::kDenominatorEps);
#pragma unroll
      for (int i = 0; i < kAcc; ++i) out[i] *= (i % 4) >= 2 ? scale_hi : scale_lo;
      store_strip(&maps.out, b, h, strip0, strip_stage, out);
      if (lane % 4 == 0) {
        p.den[static_cast<size_t>(bh) * n + row0] = den_lo;
        p.den[static_cast<size_t>(bh) * n + row0 + 8] = den_hi;
      }
    }

    // Every product and read of this set is done before its next copies start.
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncthreads();
    set = kSets == 2 ? set ^ 1 : (set + 1 == kSets ? 0 : set + 1);
  }
  finish_strip_stores();
}

template <typename T, int Tiles, int KeyTile, int Groups>
cudaError_t launch(const ResidentBlockLinearForward& a, cudaStream_t stream) {
  const auto& s = a.shape;
  cudaError_t err = cudaSuccess;
  const auto kernel = resident_warpgroup_forward_kernel<T, Tiles, KeyTile, Groups>;
  const size_t bytes = SmemPlan(s.tokens, Groups * 4).bytes();
  if ((err = tiles::allow_smem(kernel, bytes)) != cudaSuccess) return err;
  InputMaps maps;
  if ((err = encode_rows(&maps.q, a.q, s)) != cudaSuccess ||
      (err = encode_rows(&maps.k, a.k, s)) != cudaSuccess ||
      (err = encode_rows(&maps.v, a.v, s)) != cudaSuccess ||
      (err = encode_output_strips(&maps.out, a.out, s)) != cudaSuccess)
    return err;
  const int pairs = s.batch * s.heads;
  const int grid = pairs < multiprocessors() ? pairs : multiprocessors();
  kernel<<<grid, Groups * 128, bytes, stream>>>(a, maps);
  return cudaGetLastError();
}

}  // namespace

bool resident_warpgroup_forward_takes(const ResidentBlockLinearForward& args) {
  return shape_supported(args.shape, args.dtype) && copyable(args.q) && copyable(args.k) &&
         copyable(args.v) && storable(args.out);
}

cudaError_t resident_warpgroup_forward(const ResidentBlockLinearForward& args,
                                       cudaStream_t stream) {
  if (!resident_warpgroup_forward_takes(args) || args.den == nullptr ||
      (args.mixing == nullptr && args.shape.blocks != 1))
    return cudaErrorInvalidValue;
  static const bool two_groups = [] {
    const char* value = std::getenv("MHLA_WARPGROUP_FORWARD_GROUPS");
    return value != nullptr && std::string(value) == "2";
  }();
  return dispatch_tiles(args.shape.tokens, [&](auto tiles, auto key_tile) {
    constexpr int kTiles = decltype(tiles)::value, kKeyTile = decltype(key_tile)::value;
    if constexpr (kTiles >= 3) {
      // One warpgroup per query tile: each holds one sweep's registers (at most 128 per thread
      // at four warpgroups: 64-key products).
      if (!two_groups)
        return args.dtype == DType::bf16
                   ? launch<__nv_bfloat16, kTiles, kTile, kTiles>(args, stream)
                   : launch<__half, kTiles, kTile, kTiles>(args, stream);
    }
    return args.dtype == DType::bf16 ? launch<__nv_bfloat16, kTiles, kKeyTile, 2>(args, stream)
                                     : launch<__half, kTiles, kKeyTile, 2>(args, stream);
  });
}

}  // namespace mhla_kernels
