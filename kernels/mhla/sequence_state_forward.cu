// MHLA's forward for short sequences of 64-token blocks in one kernel: see
// sequence_state_forward.h.
//
// Why one CTA per sequence: session 16's walked its tiles with one load in flight and a CTA
// barrier per step (4.5 GB/s per multiprocessor). Here a producer warp keeps a ring of 16 KiB
// tensor copies in flight across the phases and the (batch, head) items; the states take 128 KiB
// of shared memory, so the ring (what is in flight per multiprocessor, and so the bandwidth) is
// as deep as the rest allows: five slots, with the outputs staged in the query tiles' own rows.
// Warpgroup g owns the blocks i with (i / 2) % 2 == g in both phases, so it can start the next
// item's states while the other warpgroup finishes its outputs: the two meet twice per item
// (states complete, mix complete).
//
// Per item: phase A, block j's k and v arrive in one slot, its warpgroup writes phi(k) in place
// (two threads per row), then each warp forms 16 rows of S_j = phi(k)^T [v, 1] (the ones column
// gives z_j), rounds them to bf16 into state tile j and copies them to the packed set S. Then
// every warp mixes its 64 pieces of every state in place (S'_i = sum_j m_ij S_j, one m16n8k16
// product per 8 columns with the 16 states as the depth). Phase C, two query tiles per slot:
// phi(q) in place with den = phi(q) . z'_i (one thread per row), then each warp forms 16 rows of
// phi(q) S'_i, writes them divided by den + eps over its own phi(q) rows and stores them from
// there; its rows of S'_i go to the packed set S'.
#include "common/device_info.h"
#include "common/tensor_copy.cuh"
#include "mhla/resident_warpgroup_tiles.cuh"
#include "mhla/sequence_state_forward.h"

namespace mhla_kernels {
namespace {

namespace tc = tensor_copy;
namespace rw = resident_warpgroup;
using wmma_tiles::detail::load_matrices;
using wmma_tiles::detail::mma16816;

constexpr int kD = 64, kTile = 64, kMaxBlocks = 16;
constexpr int kConsumerWarps = 8, kConsumerThreads = 32 * kConsumerWarps;
constexpr int kThreads = kConsumerThreads + 32;  // and one producer warp
constexpr int kSlots = 5;                        // item n of a CTA goes to slot n % 5
constexpr uint32_t kTileBytes = kTile * kD * 2;
constexpr uint32_t kSlotBytes = 2 * kTileBytes;  // k and v, or two query tiles
// States sit 16 bytes further apart than their size: the same 16-byte piece of eight
// consecutive states then falls in eight different bank quads (the mix reads and writes one
// piece of every state at a time).
constexpr uint32_t kStateBytes = kTileBytes + 16;
constexpr int kPackedZ = kD * kD / 2, kPackedFloats = kPackedZ + kD;  // PackedState<64>

// Barrier ids: 0 is __syncthreads; the consumers' (256 threads); one per warpgroup (128).
constexpr int kConsumersBarrier = 1, kGroupBarrier0 = 2;

template <typename T>
using RingTile = warpgroup::SwizzledTile<T, 2 * kTile>;  // a slot: rows 0-63 k (or q), 64-127 v (q)
template <typename T>
using StateTile = warpgroup::SwizzledTile<T, kTile>;  // the same swizzle, by row index

struct SmemPlan {
  static constexpr size_t ring = kSlots * static_cast<size_t>(kSlotBytes);
  static constexpr size_t states = kMaxBlocks * static_cast<size_t>(kStateBytes);
  static constexpr size_t z = kMaxBlocks * kD * 4;  // z_j, then z'_i
  static constexpr size_t den = 2 * 2 * 2 * kTile * 4;  // per warpgroup, two items, 128 rows
  static constexpr size_t mixing = kMaxBlocks * kMaxBlocks * 4;  // zero past M
  static constexpr size_t barriers = 2 * kSlots * 8;
  static constexpr size_t bytes = rw::kTileAlignment + ring + tiles::align128(states) +
                                  2 * z + den + mixing + barriers;
};

struct Maps {
  CUtensorMap q, k, v;  // 64-row boxes
  CUtensorMap out;      // 16-row boxes (store_strip)
};

__device__ __forceinline__ void sync_named(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// Items of a (batch, head), in the order the producer issues them: block j's k and v (j < M),
// then query tiles 2u and 2u + 1 (item M + u). Item n of a CTA (counted over its (batch, head)
// items) lands in slot n % kSlots, its (n / kSlots)-th use. Each item's warpgroup consumes its
// items in that order, so no wait of either waits on a copy the producer has not started.
__device__ __forceinline__ int owner_of_block(int block) {
  return (block / 2) % 2;
}

// The producer: one thread starts each item's copies once its slot's previous item is released.
template <typename T>
__device__ void produce(const Maps& maps, const BlockLinearShape& s, T* ring, uint64_t* full,
                        uint64_t* empty) {
  const int pairs = s.batch * s.heads, blocks = s.blocks, query_items = (blocks + 1) / 2;
  uint32_t n = 0;
  auto take_slot = [&]() {
    const int slot = static_cast<int>(n % kSlots);
    if (n >= kSlots) tc::wait(empty + slot, (n / kSlots - 1) & 1);
    ++n;
    return slot;
  };
  for (int bh = blockIdx.x; bh < pairs; bh += gridDim.x) {
    const int b = bh / s.heads, h = bh % s.heads;
    for (int j = 0; j < blocks; ++j) {
      const int slot = take_slot();
      T* dst = ring + static_cast<size_t>(slot) * (kSlotBytes / 2);
      tc::arrive_expecting(full + slot, kSlotBytes);
      tc::copy_swizzled_token_rows(dst, &maps.k, kTile * j, h, b, full + slot);
      tc::copy_swizzled_token_rows(dst + kTile * kD, &maps.v, kTile * j, h, b, full + slot);
    }
    for (int u = 0; u < query_items; ++u) {
      const int slot = take_slot();
      T* dst = ring + static_cast<size_t>(slot) * (kSlotBytes / 2);
      const bool two = 2 * u + 1 < blocks;
      tc::arrive_expecting(full + slot, two ? kSlotBytes : kTileBytes);
      tc::copy_swizzled_token_rows(dst, &maps.q, 2 * kTile * u, h, b, full + slot);
      if (two)
        tc::copy_swizzled_token_rows(dst + kTile * kD, &maps.q, 2 * kTile * u + kTile, h, b,
                                     full + slot);
    }
  }
}

// The feature-map scale of a row and its packed-pair constants (rw::scaled_relu_pair).
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

template <typename T, int Pieces>
__device__ __forceinline__ float sum_of_squares(const uint4 (&pieces)[Pieces]) {
  float squares = 0.f;
#pragma unroll
  for (int c = 0; c < Pieces; ++c) {
    const unsigned* words = reinterpret_cast<const unsigned*>(&pieces[c]);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float a, b;
      unpack_pair<T>(words[i], a, b);
      squares = fmaf(a, a, fmaf(b, b, squares));
    }
  }
  return squares;
}

// phi(k) in place for half a row (pieces 4 half .. 4 half + 3 of row r); the lane pair
// (2 r', 2 r' + 1) of a warp holds one row.
template <typename T>
__device__ __forceinline__ void key_features(RingTile<T> tile, int r, int half) {
  uint4 pieces[4];
#pragma unroll
  for (int c = 0; c < 4; ++c)
    pieces[c] = *reinterpret_cast<const uint4*>(tile.at(r, 8 * (4 * half + c)));
  float squares = sum_of_squares<T>(pieces);
  squares += __shfl_xor_sync(0xffffffffu, squares, 1);
  const auto f = FeatureScale::of<T>(rsqrtf(squares / kD + tiles::kNormEps));
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    unsigned* words = reinterpret_cast<unsigned*>(&pieces[c]);
#pragma unroll
    for (int i = 0; i < 4; ++i) words[i] = rw::scaled_relu_pair<T>(words[i], f.head, f.tail, f.floor);
    *reinterpret_cast<uint4*>(tile.at(r, 8 * (4 * half + c))) = pieces[c];
  }
}

// phi(q) in place for row r; returns phi(q) . z' (fp32, phi as the products see it).
template <typename T>
__device__ __forceinline__ float query_features(RingTile<T> tile, int r, const float* zm) {
  uint4 pieces[kD / 8];
#pragma unroll
  for (int c = 0; c < kD / 8; ++c) pieces[c] = *reinterpret_cast<const uint4*>(tile.at(r, 8 * c));
  const auto f = FeatureScale::of<T>(rsqrtf(sum_of_squares<T>(pieces) / kD + tiles::kNormEps));
  float den = 0.f;
#pragma unroll
  for (int c = 0; c < kD / 8; ++c) {
    unsigned* words = reinterpret_cast<unsigned*>(&pieces[c]);
    const float4 z0 = *reinterpret_cast<const float4*>(zm + 8 * c);
    const float4 z1 = *reinterpret_cast<const float4*>(zm + 8 * c + 4);
    const float zs[8] = {z0.x, z0.y, z0.z, z0.w, z1.x, z1.y, z1.z, z1.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      words[i] = rw::scaled_relu_pair<T>(words[i], f.head, f.tail, f.floor);
      float a, b;
      unpack_pair<T>(words[i], a, b);
      den = fmaf(a, zs[2 * i], fmaf(b, zs[2 * i + 1], den));
    }
    *reinterpret_cast<uint4*>(tile.at(r, 8 * c)) = pieces[c];
  }
  return den;
}

// Rows row0 .. row0 + 15 of a state tile out to its packed state (row-major D x D), 16-byte
// pieces, a warp's 2 KiB contiguous in global memory.
template <typename T>
__device__ __forceinline__ void copy_state_rows(StateTile<T> tile, int row0, float* packed) {
  T* const matrix = reinterpret_cast<T*>(packed);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int e = static_cast<int>(threadIdx.x % 32) + 32 * k, r = row0 + e / 8, c = e % 8;
    *reinterpret_cast<uint4*>(matrix + r * kD + 8 * c) =
        *reinterpret_cast<const uint4*>(tile.at(r, 8 * c));
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads, 1)
    sequence_state_forward_kernel(SequenceStateForward p, const __grid_constant__ Maps maps) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  unsigned char* const smem = rw::align_tiles(smem_raw);
  const auto& s = p.shape;
  const int blocks = s.blocks, pairs = s.batch * s.heads, query_items = (blocks + 1) / 2;
  T* const ring = reinterpret_cast<T*>(smem);
  T* const states = reinterpret_cast<T*>(smem + SmemPlan::ring);
  float* const z =
      reinterpret_cast<float*>(smem + SmemPlan::ring + tiles::align128(SmemPlan::states));
  float* const zm = z + kMaxBlocks * kD;
  float* const den = zm + kMaxBlocks * kD;  // [group][item parity][128 rows]
  float* const mix = den + 2 * 2 * 2 * kTile;  // [16][16], zero past M
  uint64_t* const full = reinterpret_cast<uint64_t*>(mix + kMaxBlocks * kMaxBlocks);
  uint64_t* const empty = full + kSlots;

  for (int e = threadIdx.x; e < kMaxBlocks * kMaxBlocks; e += kThreads) {
    const int i = e / kMaxBlocks, j = e % kMaxBlocks;
    mix[e] = i < s.blocks && j < s.blocks ? p.mixing[i * s.blocks + j] : 0.f;
  }
  if (threadIdx.x == 0) {
    for (int i = 0; i < kSlots; ++i) {
      tc::init(full + i);
      tc::init(empty + i, 4);  // one arrival per warp of the item's warpgroup
    }
    tc::fence_init();
  }
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (warp == kConsumerWarps) {
    if (lane == 0) produce<T>(maps, s, ring, full, empty);
    return;
  }

  const int group = warp / 4, group_warp = warp % 4, group_thread = threadIdx.x % 128;
  const int g8 = lane / 4, quad = lane / 8, row8 = lane % 8, c0 = 2 * (lane % 4);
  const unsigned ones = pack_pair<T>(1.f, 1.f);
  auto state_tile = [&](int j) { return StateTile<T>{states + j * (kStateBytes / 2)}; };
  auto release = [&](int slot) {  // this warp's reads (and in-place writes) of a slot are done
    tc::fence_for_copy_engine();
    __syncwarp();
    if (lane == 0) tc::arrive(empty + slot);
  };

  // m in bf16 high and low parts as the A fragments of the mix (rows i, columns j; zero past M).
  unsigned m_hi[4], m_lo[4];
#pragma unroll
  for (int f = 0; f < 4; ++f) {
    const int i = g8 + 8 * (f % 2), j = c0 + 8 * (f / 2);
    float w[2];
#pragma unroll
    for (int e = 0; e < 2; ++e)
      w[e] = i < blocks && j + e < blocks ? p.mixing[i * blocks + j + e] : 0.f;
    m_hi[f] = pack_pair<T>(w[0], w[1]);
    float h0, h1;
    unpack_pair<T>(m_hi[f], h0, h1);
    m_lo[f] = pack_pair<T>(w[0] - h0, w[1] - h1);
  }

  auto wait_item = [&](uint32_t n) {  // item n (producer order) has arrived; its slot
    const int slot = static_cast<int>(n % kSlots);
    tc::wait(full + slot, (n / kSlots) & 1);
    return slot;
  };
  const int items_per_pair = blocks + query_items;
  uint32_t first_item = 0;  // of this (batch, head), in producer order
  for (int bh = blockIdx.x; bh < pairs; bh += gridDim.x, first_item += items_per_pair) {
    const int b = bh / s.heads, h = bh % s.heads;
    float* const state_set = p.states + static_cast<size_t>(bh) * blocks * kPackedFloats;
    float* const mixed_set = p.mixed + static_cast<size_t>(bh) * blocks * kPackedFloats;

    // Phase A: the block states of this warpgroup's blocks.
    for (int j = 0; j < blocks; ++j) {
      if (owner_of_block(j) != group) continue;
      const int slot = wait_item(first_item + j);
      const RingTile<T> kv{ring + slot * (kSlotBytes / 2)};
      key_features<T>(kv, group_thread / 2, group_thread % 2);
      sync_named(kGroupBarrier0 + group, 128);
      // Rows 16 w .. 16 w + 15 (d) of phi(k)^T [v, 1]: A = phi(k) read transposed, B = v (rows
      // 64 .. 127 of the slot) with the tokens as the depth; the ones column gives z_j.
      float acc[32] = {}, zacc[4] = {};
#pragma unroll
      for (int kk = 0; kk < kTile; kk += 16) {
        unsigned fa[4];
        load_matrices<true>(fa, kv.at(kk + (quad / 2) * 8 + row8, 16 * group_warp + (quad % 2) * 8));
#pragma unroll
        for (int n = 0; n < 4; ++n) {
          unsigned fb[4];
          load_matrices<true>(fb, kv.at(kTile + kk + (quad % 2) * 8 + row8, 16 * n + (quad / 2) * 8));
          mma16816<T>(*reinterpret_cast<float(*)[4]>(&acc[8 * n]), fa, fb[0], fb[1]);
          mma16816<T>(*reinterpret_cast<float(*)[4]>(&acc[8 * n + 4]), fa, fb[2], fb[3]);
        }
        mma16816<T>(zacc, fa, ones, ones);
      }
      release(slot);
      const StateTile<T> st = state_tile(j);
      const int d = 16 * group_warp + g8;
#pragma unroll
      for (int n = 0; n < 8; ++n) {
        *reinterpret_cast<unsigned*>(st.at(d, 8 * n + c0)) = pack_pair<T>(acc[4 * n], acc[4 * n + 1]);
        *reinterpret_cast<unsigned*>(st.at(d + 8, 8 * n + c0)) =
            pack_pair<T>(acc[4 * n + 2], acc[4 * n + 3]);
      }
      if (lane % 4 == 0) {
        z[j * kD + d] = zacc[0];
        z[j * kD + d + 8] = zacc[2];
        state_set[j * kPackedFloats + kPackedZ + d] = zacc[0];
        state_set[j * kPackedFloats + kPackedZ + d + 8] = zacc[2];
      }
      // This warp's rows of S_j leave now, while the next item's copies are awaited.
      __syncwarp();
      copy_state_rows<T>(st, 16 * group_warp, state_set + j * kPackedFloats);
    }
    sync_named(kConsumersBarrier, kConsumerThreads);

    // S' = m S in place, this warp's 64 pieces of every state; z' = m z.
    const int piece0 = 64 * warp;
    for (int it = 0; it < 32; ++it) {
      const int piece = piece0 + 2 * it;
      const int j = (quad % 2) * 8 + row8, mine = piece + quad / 2;
      unsigned fb[4];
      load_matrices<true>(fb, state_tile(j < blocks ? j : 0).at(mine / 8, 8 * (mine % 8)));
      // Every lane's read of these two pieces comes before any lane's write of them (the
      // products already order them; the warp barrier says so to the race checker).
      __syncwarp();
      float out[2][4] = {};
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        mma16816<T>(out[e], m_hi, fb[2 * e], fb[2 * e + 1]);
        mma16816<T>(out[e], m_lo, fb[2 * e], fb[2 * e + 1]);
        const int pe = piece + e, d = pe / 8, col = 8 * (pe % 8) + c0;
        if (g8 < blocks)
          *reinterpret_cast<unsigned*>(state_tile(g8).at(d, col)) = pack_pair<T>(out[e][0], out[e][1]);
        if (g8 + 8 < blocks)
          *reinterpret_cast<unsigned*>(state_tile(g8 + 8).at(d, col)) =
              pack_pair<T>(out[e][2], out[e][3]);
      }
    }
    for (int e = threadIdx.x; e < blocks * kD; e += kConsumerThreads) {
      const int i = e / kD, d = e % kD;
      float total = 0.f;
#pragma unroll
      for (int j = 0; j < kMaxBlocks; ++j)
        if (j < blocks) total = fmaf(mix[i * kMaxBlocks + j], z[j * kD + d], total);
      zm[e] = total;
    }
    sync_named(kConsumersBarrier, kConsumerThreads);

    // Phase C: the outputs of this warpgroup's query tiles, two per slot.
    for (int u = group; u < query_items; u += 2) {  // tiles 2u, 2u + 1: owner_of_block is u % 2
      const int slot = wait_item(first_item + blocks + u);
      const RingTile<T> qt{ring + slot * (kSlotBytes / 2)};
      float* const item_den = den + (2 * group + (u / 2) % 2) * 2 * kTile;
      const int row = group_thread, block_of_row = 2 * u + row / kTile;
      if (block_of_row < blocks) item_den[row] = query_features<T>(qt, row, zm + block_of_row * kD);
      sync_named(kGroupBarrier0 + group, 128);
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int i = 2 * u + half;
        if (i >= blocks) break;
        const int row0 = kTile * half + 16 * group_warp;
        const StateTile<T> st = state_tile(i);
        float acc[32] = {};
#pragma unroll
        for (int kk = 0; kk < kD; kk += 16) {
          unsigned fa[4];
          load_matrices<false>(fa, qt.at(row0 + (quad % 2) * 8 + row8, kk + (quad / 2) * 8));
#pragma unroll
          for (int n = 0; n < 4; ++n) {
            unsigned fb[4];
            load_matrices<true>(fb, st.at(kk + (quad % 2) * 8 + row8, 16 * n + (quad / 2) * 8));
            mma16816<T>(*reinterpret_cast<float(*)[4]>(&acc[8 * n]), fa, fb[0], fb[1]);
            mma16816<T>(*reinterpret_cast<float(*)[4]>(&acc[8 * n + 4]), fa, fb[2], fb[3]);
          }
        }
        const float inv_lo = 1.f / (item_den[row0 + g8] + tiles::kDenominatorEps);
        const float inv_hi = 1.f / (item_den[row0 + g8 + 8] + tiles::kDenominatorEps);
#pragma unroll
        for (int n = 0; n < 8; ++n) {
          acc[4 * n] *= inv_lo, acc[4 * n + 1] *= inv_lo;
          acc[4 * n + 2] *= inv_hi, acc[4 * n + 3] *= inv_hi;
        }
        // Over this warp's own phi(q) rows (no other warp reads them), then out by the copy
        // engine; the slot is released once that store has read them.
        const rw::Strip<T> strip{qt.p + row0 * kD};
        rw::store_strip(&maps.out, b, h, kTile * i + 16 * group_warp, strip, acc);
        // S'_i and z'_i leave with its outputs: this warp's 16 rows, z' by the group's warp 0.
        copy_state_rows<T>(st, 16 * group_warp, mixed_set + i * kPackedFloats);
        if (group_warp == 0) {
          const float2 pair = *reinterpret_cast<const float2*>(zm + i * kD + 2 * lane);
          *reinterpret_cast<float2*>(mixed_set + i * kPackedFloats + kPackedZ + 2 * lane) = pair;
        }
      }
      if (lane == 0) tc::wait_stores_read();
      release(slot);
    }
    // No barrier here: the next item's states of this warpgroup replace only the S'_i it read
    // (after a barrier of its own warps), and the mix waits for both warpgroups.
  }
  rw::finish_strip_stores();
}

}  // namespace

bool sequence_state_forward_supported(const BlockLinearShape& s, DType dtype) {
  return dtype == DType::bf16 && s.head_dim == kD && s.blocks >= 1 && s.blocks <= kMaxBlocks &&
         s.tokens == kTile * s.blocks && s.batch > 0 && s.heads > 0 &&
         static_cast<int64_t>(s.batch) * s.heads <= 2147483647LL;
}

bool sequence_state_forward_takes(const SequenceStateForward& a) {
  const auto aligned = [](const void* data) { return reinterpret_cast<uintptr_t>(data) % 16 == 0; };
  return sequence_state_forward_supported(a.shape, a.dtype) && a.mixing != nullptr &&
         rw::copyable(a.q) && rw::copyable(a.k) && rw::copyable(a.v) && rw::storable(a.out) &&
         aligned(a.states) && aligned(a.mixed);
}

cudaError_t sequence_state_forward(const SequenceStateForward& a, cudaStream_t stream) {
  if (!sequence_state_forward_takes(a)) return cudaErrorInvalidValue;
  const auto& s = a.shape;
  const auto kernel = sequence_state_forward_kernel<__nv_bfloat16>;
  cudaError_t err = tiles::allow_smem(kernel, SmemPlan::bytes);
  if (err != cudaSuccess) return err;
  Maps maps;
  const auto encode = [&](CUtensorMap* map, const TokenTensor& t) {
    return encode_swizzled_token_view_map(map, t.data, s.batch, s.tokens, s.heads, t.batch_stride,
                                          t.token_stride, t.head_stride, kTile);
  };
  if ((err = encode(&maps.q, a.q)) != cudaSuccess || (err = encode(&maps.k, a.k)) != cudaSuccess ||
      (err = encode(&maps.v, a.v)) != cudaSuccess ||
      (err = rw::encode_output_strips(&maps.out, a.out, s)) != cudaSuccess)
    return err;
  const int pairs = s.batch * s.heads;
  const int grid = pairs < multiprocessors() ? pairs : multiprocessors();
  kernel<<<grid, kThreads, SmemPlan::bytes, stream>>>(a, maps);
  return cudaGetLastError();
}

}  // namespace mhla_kernels
