// The dense-form short-sequence backward on warpgroup products: see
// resident_warpgroup_backward.h. A persistent grid (one CTA of two warpgroups per multiprocessor)
// walks the (batch, head) pairs; warpgroup w owns the key tiles w, w + 2 (first sweep: dv, dk,
// dm) and then the query tiles w, w + 2 (second sweep: dq; with an odd number of tiles the query
// tiles go the other way round, so that both warpgroups get the same number of tiles in all);
// each sweep walks all tiles of the other side (64 tokens; 128 keys in the dq sweep when N is a
// multiple of 128).
//
// Measured on the H200 (session 36), the first version was bound by issue latency, not by the
// tensor cores: a fifth of the time went to loading each pair with nothing else resident, a
// third to the elementwise work between products, an eighth to the gradient stores. Hence: the
// tensor copy engine (TMA) brings whole 32 KiB tiles, the next pair's q and k already during this
// pair's dq sweep (an L2 prefetch of the next pair's rows cost 25 us of 289 in session 37, and
// 2 us of 226 again in session 39 with whole-row copies: no prefetch); the mixing weights are read
// per 16 x 16 chunk pair from a table (no divisions), dm's four chunk sums of a warp are reduced
// together; the sweeps are pipelined (the next tile's products are committed ahead of the ones
// that consume this tile, which then run during the next tile's elementwise work: 227 -> 218 us in
// session 39); the raw q and k that the feature map's
// backward needs stay in shared memory beside their features; and the gradients leave through a
// per-warp staging strip through the copy engine.
#include "common/device_info.h"
#include "common/tensor_copy.cuh"
#include "mhla/resident_warpgroup_backward.h"
#include "mhla/resident_warpgroup_tiles.cuh"

namespace mhla_kernels {
namespace {

using namespace resident_warpgroup;
using tiles::kDenominatorEps;
using tiles::kFeatureFloor;
using tiles::kNormEps;

struct SmemPlan {
  size_t tile, vector, chunk_pairs, stage;
  __host__ __device__ explicit SmemPlan(int n)
      : tile(kTileBytes),
        vector(tiles::align128(static_cast<size_t>(n) * 4)),
        chunk_pairs(tiles::align128(static_cast<size_t>(n / kChunk) * (n / kChunk) * 4)),
        stage(static_cast<size_t>(kWarps) * kStripBytes) {}
  // Six tiles (raw q and k, phi(q), phi(k), v, g; the forward's output passes through phi(k)'s);
  // staging strips; 1 / rms of q and k, gd; two weight tables and dm's parts; two barriers.
  __host__ __device__ size_t bytes() const {
    return kTileAlignment + 6 * tile + 3 * vector + 3 * chunk_pairs + stage + 128;
  }
};

// Tensor maps of the five [B, N, H, D] inputs, one box = all N rows of one (batch, head), and of
// the three gradients, one box = a warp's 16-row strip.
struct InputMaps {
  CUtensorMap q, k, v, grad_out, out;
  CUtensorMap grad_q, grad_k, grad_v;
};

// Row r of gs holds do; afterwards g = do / (den + eps). Returns gd = -(do . o) / (den + eps),
// with o row r of the forward's output.
template <typename T>
__device__ __forceinline__ float scale_gradient_row(Tile<T> gs, Tile<T> out, int r, float den) {
  float x[kD];
  read_row(gs, r, x);
  const float scale = 1.f / (den + kDenominatorEps);
  float dot = 0.f;
#pragma unroll
  for (int c = 0; c < kD / 8; ++c) {
    const uint4 piece = *reinterpret_cast<const uint4*>(out.at(r, 8 * c));
    const unsigned* words = reinterpret_cast<const unsigned*>(&piece);
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

// The raw (pre-feature-map) elements of a thread's accumulator positions, as element pairs.
struct RawPairs {
  unsigned lo[kAcc / 4], hi[kAcc / 4];
};

// Bank-conflict free: the 32 lanes read 128 contiguous bytes (eight rows of one column block).
template <typename T>
__device__ __forceinline__ void load_raw(RawPairs& x, Tile<T> raw, int row0) {
  const int c0 = 2 * (threadIdx.x % 4);
#pragma unroll
  for (int j = 0; j < kAcc / 4; ++j) {
    x.lo[j] = *reinterpret_cast<const unsigned*>(raw.at(row0, c0 + 8 * j));
    x.hi[j] = *reinterpret_cast<const unsigned*>(raw.at(row0 + 8, c0 + 8 * j));
  }
}

// dx = s (relu'(y) dphi - y (y . relu'(y) dphi) / D) with y = x s, s = 1 / rms(x), in place for
// the two rows of a thread (the four lanes of a quad hold a row between them).
template <typename T>
__device__ __forceinline__ void feature_gradient(float (&acc)[kAcc], const RawPairs& raw,
                                                 float s_lo, float s_hi) {
  float x[kAcc];
#pragma unroll
  for (int j = 0; j < kAcc / 4; ++j) {
    unpack_pair<T>(raw.lo[j], x[4 * j], x[4 * j + 1]);
    unpack_pair<T>(raw.hi[j], x[4 * j + 2], x[4 * j + 3]);
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
}

// Sums four per-lane values over the warp in six shuffles; lane l ends with the total of value
// (l / 8) % 4.
__device__ __forceinline__ float warp_sum4(const float (&v)[4]) {
  const int lane = threadIdx.x % 32;
  const bool upper = lane & 16, odd = lane & 8;
  float keep0 = upper ? v[2] : v[0], keep1 = upper ? v[3] : v[1];
  keep0 += __shfl_xor_sync(0xffffffffu, upper ? v[0] : v[2], 16);
  keep1 += __shfl_xor_sync(0xffffffffu, upper ? v[1] : v[3], 16);
  float keep = odd ? keep1 : keep0;
  keep += __shfl_xor_sync(0xffffffffu, odd ? keep0 : keep1, 8);
#pragma unroll
  for (int offset = 4; offset > 0; offset /= 2) keep += __shfl_xor_sync(0xffffffffu, keep, offset);
  return keep;
}

// Tiles: N / 64 (the sweeps are unrolled over it); KeyTile: keys per dP product of the dq sweep
// (64, or 128 when N is a multiple of 128).
template <typename T, int Tiles, int KeyTile>
__global__ void __launch_bounds__(kThreads, 1)
    resident_warpgroup_backward_kernel(ResidentBlockLinearBackward p,
                                       const __grid_constant__ InputMaps maps) {
  extern __shared__ __align__(128) unsigned char smem[];
  const auto& s = p.shape;
  constexpr int n = Tiles * kTile, tile_count = Tiles, chunks = n / kChunk;
  const bool mixes = p.mixing != nullptr;
  const int blocks = mixes ? s.blocks : 1;
  const int block_chunks = chunks / blocks;  // 16-token chunks per block
  const SmemPlan plan(n);
  tiles::Carver carve{align_tiles(smem)};
  // phi(q) and the raw q trade places every pair: the next pair's q arrives where phi(q) was, in
  // the second sweep (which reads only phi(k), v, g and the raw q); the next k where the raw k was.
  Tile<T> qf{carve.take<T>(plan.tile)}, q_raw{carve.take<T>(plan.tile)};
  const Tile<T> kf{carve.take<T>(plan.tile)}, k_raw{carve.take<T>(plan.tile)},
      vs{carve.take<T>(plan.tile)}, gs{carve.take<T>(plan.tile)};
  T* stage = carve.take<T>(plan.stage);  // 1024-byte aligned: it follows whole tiles
  float* inv_rms_q = carve.take<float>(plan.vector);
  float* inv_rms_k = carve.take<float>(plan.vector);
  float* gd = carve.take<float>(plan.vector);
  // Mixing weight of each (query chunk, key chunk), in both orders; dm's parts per chunk pair.
  float* weight_by_query = carve.take<float>(plan.chunk_pairs);  // [query chunk][key chunk]
  float* weight_by_key = carve.take<float>(plan.chunk_pairs);    // [key chunk][query chunk]
  float* dm_parts = carve.take<float>(plan.chunk_pairs);         // [key chunk][query chunk]
  // [0]: raw q and k; [1]: do, out; [2]: v; [3]: every thread through the key sweep (odd tile
  // counts).
  uint64_t* arrived = carve.take<uint64_t>(128);
  uint64_t* key_sweep_done = arrived + 3;

  const int group = threadIdx.x / 128, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  const int c0 = 2 * (lane % 4);
  const Strip<T> strip_stage{stage + (threadIdx.x / 32) * kStripRows * kD};

  fill_weight_tables(p.mixing, chunks, blocks, weight_by_query, weight_by_key);

  const int pairs = s.batch * s.heads;
  const int stride = gridDim.x;
  namespace tc = tensor_copy;
  if (threadIdx.x == 0) {
    tc::init(arrived);
    tc::init(arrived + 1);
    tc::init(arrived + 2);
    if constexpr (tile_count % 2 == 1) tc::init(key_sweep_done, kThreads);
    tc::fence_init();
    if (blockIdx.x < pairs) {
      const int b = blockIdx.x / s.heads, h = blockIdx.x % s.heads;
      tc::arrive_expecting(arrived, 2 * pair_tile_bytes(n));
      copy_pair_rows(q_raw, &maps.q, b, h, arrived);
      copy_pair_rows(k_raw, &maps.k, b, h, arrived);
    }
  }
  __syncthreads();

  uint32_t parity = 0;
  for (int bh = blockIdx.x; bh < pairs; bh += stride, parity ^= 1) {
    const int b = bh / s.heads, h = bh % s.heads;
    const int next = bh + stride;

    // The raw q and k are here or on their way (started in the last pair's second sweep); do and
    // the output start now (the output through phi(k)'s tile) and arrive while phi(q) is made; v,
    // which only the sweeps read, comes last, on its own barrier, while g and phi(k) are made.
    if (threadIdx.x == 0) {
      tc::arrive_expecting(arrived + 1, 2 * pair_tile_bytes(n));
      copy_pair_rows(gs, &maps.grad_out, b, h, arrived + 1);
      copy_pair_rows(kf, &maps.out, b, h, arrived + 1);
      tc::arrive_expecting(arrived + 2, pair_tile_bytes(n));
      copy_pair_rows(vs, &maps.v, b, h, arrived + 2);
    }
    const int row = threadIdx.x;
    const float den = row < n ? p.den[static_cast<size_t>(bh) * n + row] : 0.f;
    tc::wait(arrived, parity);
    if (row < n) inv_rms_q[row] = features_of_row(q_raw, qf, row);
    tc::wait(arrived + 1, parity);
    if (row < n) {
      gd[row] = scale_gradient_row(gs, kf, row, den);  // reads row `row` of the output
      inv_rms_k[row] = features_of_row(k_raw, kf, row);
    }
    tc::wait(arrived + 2, parity);
    wg::fence_shared_for_mma();
    __syncthreads();

    // Keys: dv, dk and dm's parts. The scores and dP of the next query tile are issued right
    // behind the products that take this tile's, so one wait covers both.
    for (int kt = group; kt < tile_count; kt += 2) {
      const int key0 = kt * kTile, strip0 = key0 + 16 * warp;
      const int key_chunk = kt * (kTile / kChunk) + warp;  // this warp's 16 keys
      const int row0 = strip0 + lane / 4;
      float dv[kAcc], dk[kAcc], scores[kAcc], dp[kAcc];
      // Two fragment sets: dv and dk of one query tile run while the next one's are made.
      unsigned pa[2][kTile / 16][4], da[2][kTile / 16][4];
      zero_accumulator(dv);
      zero_accumulator(dk);
      wg::fence();
      wg::product<T, kTile, kD>(scores, kf, key0, 0, qf, 0, 0, false);
      wg::product<T, kTile, kD>(dp, vs, key0, 0, gs, 0, 0, false);
      // One query tile, its scores and dP done: the elementwise work into fragment set qt % 2.
      auto work = [&](auto step) {
        constexpr int qt = decltype(step)::value, set = qt % 2;
        const int query0 = qt * kTile;
        pin_fragments(pa[set]);
        pin_fragments(da[set]);
        float w[4];
        tile_weights(w, weight_by_key + key_chunk * chunks, qt);
        float parts[4];
#pragma unroll
        for (int jj = 0; jj < kTile / 16; ++jj) {
          const float2 g0 = *reinterpret_cast<const float2*>(gd + query0 + 16 * jj + c0);
          const float2 g1 = *reinterpret_cast<const float2*>(gd + query0 + 16 * jj + 8 + c0);
          const float* a = scores + 8 * jj;
          float* d = dp + 8 * jj;
          d[0] += g0.x, d[1] += g0.y, d[2] += g0.x, d[3] += g0.y;
          d[4] += g1.x, d[5] += g1.y, d[6] += g1.x, d[7] += g1.y;
          float part = 0.f;
#pragma unroll
          for (int e = 0; e < 8; ++e) part += a[e] * d[e];
          parts[jj] = part;
#pragma unroll
          for (int r = 0; r < 4; ++r) {
            pa[set][jj][r] = pack_pair<T>(a[2 * r] * w[jj], a[2 * r + 1] * w[jj]);
            da[set][jj][r] = pack_pair<T>(d[2 * r] * w[jj], d[2 * r + 1] * w[jj]);
          }
        }
        if (mixes) {
          const float part = warp_sum4(parts);
          if (lane % 8 == 0) dm_parts[key_chunk * chunks + 4 * qt + lane / 8] = part;
        }
      };
      auto products = [&](auto step) {
        constexpr int qt = decltype(step)::value, set = qt % 2;
        wg::product_register_a<T, kD, kTile>(dv, pa[set], gs, qt * kTile, 0, true);
        wg::product_register_a<T, kD, kTile>(dk, da[set], qf, qt * kTile, 0, true);
      };
      pipelined_sweep<tile_count, 2>(work, products, [&](int qt) {
        wg::product<T, kTile, kD>(scores, kf, key0, 0, qf, qt * kTile, 0, false);
        wg::product<T, kTile, kD>(dp, vs, key0, 0, gs, qt * kTile, 0, false);
      });
      RawPairs raw;
      load_raw<T>(raw, k_raw, row0);
      wg::wait<0>();
#pragma unroll
      for (int set = 0; set < 2; ++set) {
        pin_fragments(pa[set]);
        pin_fragments(da[set]);
      }
      store_strip(&maps.grad_v, b, h, strip0, strip_stage, dv);
      feature_gradient<T>(dk, raw, inv_rms_k[row0], inv_rms_k[row0 + 8]);
      store_strip(&maps.grad_k, b, h, strip0, strip_stage, dk);
    }

    // phi(q) and the raw k are free once every thread is through the key sweep; the next pair's
    // q and k start into them. With an odd number of tiles warpgroup 0 owns one key tile more,
    // so warpgroup 1 takes query tiles 0, 2, ... in the dq sweep (which reads neither tile) and
    // starts it at once: the threads only arrive on a barrier, and thread 0 waits for all of
    // them before the copies (this change alone, N = 64: backward 252.7 -> 234.6 us at
    // B = 1,024, H = 6, session 49). With an even number both own as many tiles and meet at a
    // CTA barrier (the arrival form measured 1.6 us slower at N = 256).
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    constexpr bool odd_tiles = tile_count % 2 == 1;
    if constexpr (odd_tiles) {
      tc::arrive(key_sweep_done);
    } else {
      __syncthreads();
    }
    if (threadIdx.x == 0 && next < pairs) {
      if constexpr (odd_tiles) tc::wait(key_sweep_done, parity);
      const int nb = next / s.heads, nh = next % s.heads;
      tc::arrive_expecting(arrived, 2 * pair_tile_bytes(n));
      copy_pair_rows(qf, &maps.q, nb, nh, arrived);
      copy_pair_rows(k_raw, &maps.k, nb, nh, arrived);
    }

    // Queries: dq, recomputing dP with the queries as rows.
    for (int qt = odd_tiles ? 1 - group : group; qt < tile_count; qt += 2) {
      const int query0 = qt * kTile, strip0 = query0 + 16 * warp;
      const int query_chunk = qt * (kTile / kChunk) + warp;
      const int row0 = strip0 + lane / 4;
      const float gd_lo = gd[row0], gd_hi = gd[row0 + 8];
      constexpr int kKeyChunks = KeyTile / kChunk;
      constexpr int key_tiles = n / KeyTile;
      float dq[kAcc], dp[KeyTile / 2];
      unsigned da[2][kKeyChunks][4];  // dq of one key tile runs while the next one's are made
      zero_accumulator(dq);
      wg::fence();
      wg::product<T, KeyTile, kD>(dp, gs, query0, 0, vs, 0, 0, false);
      auto work = [&](auto step) {
        constexpr int kt = decltype(step)::value, set = kt % 2;
        pin_fragments(da[set]);
        float w[kKeyChunks];
        tile_weights<kKeyChunks>(w, weight_by_query + query_chunk * chunks, kt);
#pragma unroll
        for (int jj = 0; jj < kKeyChunks; ++jj) {
          const float* d = dp + 8 * jj;
          da[set][jj][0] = pack_pair<T>((d[0] + gd_lo) * w[jj], (d[1] + gd_lo) * w[jj]);
          da[set][jj][1] = pack_pair<T>((d[2] + gd_hi) * w[jj], (d[3] + gd_hi) * w[jj]);
          da[set][jj][2] = pack_pair<T>((d[4] + gd_lo) * w[jj], (d[5] + gd_lo) * w[jj]);
          da[set][jj][3] = pack_pair<T>((d[6] + gd_hi) * w[jj], (d[7] + gd_hi) * w[jj]);
        }
      };
      auto products = [&](auto step) {
        constexpr int kt = decltype(step)::value;
        wg::product_register_a<T, kD, KeyTile>(dq, da[kt % 2], kf, kt * KeyTile, 0, true);
      };
      pipelined_sweep<key_tiles, 1>(work, products, [&](int kt) {
        wg::product<T, KeyTile, kD>(dp, gs, query0, 0, vs, kt * KeyTile, 0, false);
      });
      RawPairs raw;
      load_raw<T>(raw, q_raw, row0);
      wg::wait<0>();
      pin_fragments(da[0]);
      pin_fragments(da[1]);
      feature_gradient<T>(dq, raw, inv_rms_q[row0], inv_rms_q[row0 + 8]);
      store_strip(&maps.grad_q, b, h, strip0, strip_stage, dq);
    }

    // Every product, dm part and read of this pair's tiles is done before the next pair's
    // copies overwrite them.
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncthreads();
    if (mixes) {
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
    const Tile<T> swap = qf;
    qf = q_raw;
    q_raw = swap;
  }
  finish_strip_stores();
}

template <typename T, int Tiles, int KeyTile>
cudaError_t launch(const ResidentBlockLinearBackward& a, cudaStream_t stream) {
  const auto& s = a.shape;
  const int blocks = a.mixing != nullptr ? s.blocks : 1;
  cudaError_t err = cudaSuccess;
  if (a.mixing != nullptr && a.grad_mixing_parts == nullptr &&
      (err = cudaMemsetAsync(a.grad_mixing, 0, sizeof(float) * blocks * blocks, stream)) !=
          cudaSuccess)
    return err;
  const auto kernel = resident_warpgroup_backward_kernel<T, Tiles, KeyTile>;
  const size_t bytes = SmemPlan(s.tokens).bytes();
  if ((err = tiles::allow_smem(kernel, bytes)) != cudaSuccess) return err;
  InputMaps maps;
  const auto encode = [&](CUtensorMap* map, const TokenTensor& t) {
    return encode_rows(map, t, s);
  };
  if ((err = encode(&maps.q, a.q)) != cudaSuccess || (err = encode(&maps.k, a.k)) != cudaSuccess ||
      (err = encode(&maps.v, a.v)) != cudaSuccess ||
      (err = encode(&maps.grad_out, a.grad_out)) != cudaSuccess ||
      (err = encode(&maps.out, a.out)) != cudaSuccess ||
      (err = encode_output_strips(&maps.grad_q, a.grad_q, s)) != cudaSuccess ||
      (err = encode_output_strips(&maps.grad_k, a.grad_k, s)) != cudaSuccess ||
      (err = encode_output_strips(&maps.grad_v, a.grad_v, s)) != cudaSuccess)
    return err;
  const int pairs = s.batch * s.heads;
  const int grid = pairs < multiprocessors() ? pairs : multiprocessors();
  kernel<<<grid, kThreads, bytes, stream>>>(a, maps);
  return cudaGetLastError();
}

}  // namespace

bool resident_warpgroup_backward_supported(const BlockLinearShape& s, DType dtype) {
  return shape_supported(s, dtype);
}

bool resident_warpgroup_backward_takes(const ResidentBlockLinearBackward& args) {
  return shape_supported(args.shape, args.dtype) && copyable(args.q) && copyable(args.k) &&
         copyable(args.v) && copyable(args.grad_out) && copyable(args.out) &&
         storable(args.grad_q) && storable(args.grad_k) && storable(args.grad_v);
}

cudaError_t resident_warpgroup_backward(const ResidentBlockLinearBackward& args,
                                        cudaStream_t stream) {
  if (!resident_warpgroup_backward_takes(args) || args.den == nullptr ||
      (args.mixing == nullptr && args.shape.blocks != 1) ||
      (args.mixing != nullptr && args.grad_mixing == nullptr))
    return cudaErrorInvalidValue;
  return dispatch_tiles(args.shape.tokens, [&](auto tiles, auto key_tile) {
    constexpr int kTiles = decltype(tiles)::value, kKeyTile = decltype(key_tile)::value;
    return args.dtype == DType::bf16 ? launch<__nv_bfloat16, kTiles, kKeyTile>(args, stream)
                                     : launch<__half, kTiles, kKeyTile>(args, stream);
  });
}

}  // namespace mhla_kernels
