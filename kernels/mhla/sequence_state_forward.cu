// MHLA's forward for short sequences of 64-token blocks in one kernel: see
// sequence_state_forward.h.
//
// Why one CTA per sequence: session 16's walked its tiles with one load in flight and a CTA
// barrier per step (4.5 GB/s per multiprocessor). Here a producer warp keeps a ring of 16 KiB
// tensor copies in flight across the phases and the (batch, head) items (five slots beside the
// states' 128 KiB, with the outputs staged in the query tiles' own rows). All eight consumer
// warps take every item.
//
// What bounds it (session 41, clock64 per phase on two CTAs, B = 64, N = 1,024, H = 6, M = 16):
// the consumers, not the copies: they wait about 130 cycles an item for their data, while the
// producer waits about 2,000 for a free slot (nine slots at M <= 8 changed nothing; sixteen
// consumer warps were slower). A (batch, head) took 67,000 cycles, 15,000 of them in the mix
// while it mixed one piece pair at a time; a row of eight pieces a step, the next row's loads
// issued before this row's products, brought it to about 4,700 and the kernel to 92.7 us per
// launch against 105-108 us for the three kernels it replaces (Nsight, same call).
//
// Per (batch, head): phase A, block j's k and v arrive in one slot, phi(k) is written in place
// (four threads per row), then each warp forms a 16 x 32 part of S_j = phi(k)^T [v, 1] (the ones
// column gives z_j), rounds it to bf16 into state tile j and copies it to the packed set S. Then
// every warp mixes its 64 pieces of every state in place (S'_i = sum_j m_ij S_j, one m16n8k16
// product per 8 columns with the 16 states as the depth). Phase C, two query tiles per slot:
// phi(q) in place with den = phi(q) . z'_i (two threads per row), then warpgroup g takes tile
// 2u + g: each warp forms 16 rows of phi(q) S'_i, writes them divided by den + eps over its own
// phi(q) rows and stores them from there; its rows of S'_i go to the packed set S'.
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

// Barrier ids: 0 is __syncthreads; 1 the consumers' (256 threads).
constexpr int kConsumersBarrier = 1;

template <typename T>
using RingTile = warpgroup::SwizzledTile<T, 2 * kTile>;  // a slot: rows 0-63 k (or q), 64-127 v (q)
template <typename T>
using StateTile = warpgroup::SwizzledTile<T, kTile>;  // the same swizzle, by row index

struct SmemPlan {
  static constexpr size_t ring = kSlots * static_cast<size_t>(kSlotBytes);
  static constexpr size_t states = kMaxBlocks * static_cast<size_t>(kStateBytes);
  static constexpr size_t z = kMaxBlocks * kD * 4;               // z_j, then z'_i
  static constexpr size_t den = 2 * 2 * kTile * 4;               // two items (by parity), 128 rows
  static constexpr size_t mixing = kMaxBlocks * kMaxBlocks * 4;  // zero past M
  static constexpr size_t barriers = 2 * kSlots * 8;
  static constexpr size_t bytes =
      rw::kTileAlignment + ring + tiles::align128(states) + 2 * z + den + mixing + barriers;
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
// items) lands in slot n % kSlots, its (n / kSlots)-th use. Every consumer warp takes every
// item, in that order, and releases it: a warp waiting for a slot's k-th use has released its
// (k - 1)-th, so that use has completed and the wait's phase parity cannot alias an older one
// (which it could if each warpgroup skipped the other's items).

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

// phi(x) in place for Pieces 16-byte pieces of row r from piece0, the rest of the row held by
// the adjacent lanes of a group of Lanes (their squares summed by shuffles). Returns this lane's
// part of phi(x) . z (phi as the products see it; z from the row's column 8 piece0), or 0
// without z.
template <typename T, int Pieces, int Lanes>
__device__ __forceinline__ float features_in_place(RingTile<T> tile, int r, int piece0,
                                                   const float* z) {
  uint4 pieces[Pieces];
#pragma unroll
  for (int c = 0; c < Pieces; ++c)
    pieces[c] = *reinterpret_cast<const uint4*>(tile.at(r, 8 * (piece0 + c)));
  float squares = rw::sum_of_squares<T>(pieces);
#pragma unroll
  for (int offset = 1; offset < Lanes; offset *= 2)
    squares += __shfl_xor_sync(0xffffffffu, squares, offset);
  const auto f = rw::FeatureScale::of<T>(rsqrtf(squares / kD + tiles::kNormEps));
  // Four product chains for the dot, not one 8 Pieces long: it sits before the warp barrier
  // that precedes the products.
  float dots[4] = {};
#pragma unroll
  for (int c = 0; c < Pieces; ++c) {
    unsigned* words = reinterpret_cast<unsigned*>(&pieces[c]);
    float4 zz[2];
    if (z != nullptr) {
      zz[0] = *reinterpret_cast<const float4*>(z + 8 * (piece0 + c));
      zz[1] = *reinterpret_cast<const float4*>(z + 8 * (piece0 + c) + 4);
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      words[i] = rw::scaled_relu_pair<T>(words[i], f.head, f.tail, f.floor);
      if (z != nullptr) {
        const float zx = i % 2 == 0 ? zz[i / 2].x : zz[i / 2].z;
        const float zy = i % 2 == 0 ? zz[i / 2].y : zz[i / 2].w;
        float a, b;
        unpack_pair<T>(words[i], a, b);
        dots[i] = fmaf(a, zx, fmaf(b, zy, dots[i]));
      }
    }
    *reinterpret_cast<uint4*>(tile.at(r, 8 * (piece0 + c))) = pieces[c];
  }
  return (dots[0] + dots[1]) + (dots[2] + dots[3]);
}

// Rows row0 .. row0 + 15, columns col0 .. col0 + Cols - 1 of a state tile out to its packed
// state (row-major D x D) in 16-byte pieces.
template <typename T, int Cols>
__device__ __forceinline__ void copy_state_rows(StateTile<T> tile, int row0, int col0,
                                                float* packed) {
  constexpr int kPiecesPerRow = Cols / 8;
  T* const matrix = reinterpret_cast<T*>(packed);
#pragma unroll
  for (int k = 0; k < 16 * kPiecesPerRow / 32; ++k) {
    const int e = static_cast<int>(threadIdx.x % 32) + 32 * k;
    const int r = row0 + e / kPiecesPerRow, c = col0 + 8 * (e % kPiecesPerRow);
    *reinterpret_cast<uint4*>(matrix + r * kD + c) = *reinterpret_cast<const uint4*>(tile.at(r, c));
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
  float* const den = zm + kMaxBlocks * kD;  // [item parity][128 rows]
  float* const mix = den + 2 * 2 * kTile;   // [16][16], zero past M
  uint64_t* const full = reinterpret_cast<uint64_t*>(mix + kMaxBlocks * kMaxBlocks);
  uint64_t* const empty = full + kSlots;

  for (int e = threadIdx.x; e < kMaxBlocks * kMaxBlocks; e += kThreads) {
    const int i = e / kMaxBlocks, j = e % kMaxBlocks;
    mix[e] = i < s.blocks && j < s.blocks ? p.mixing[i * s.blocks + j] : 0.f;
  }
  if (threadIdx.x == 0) {
    for (int i = 0; i < kSlots; ++i) {
      tc::init(full + i);
      tc::init(empty + i, kConsumerWarps);  // one arrival per consumer warp
    }
    tc::fence_init();
  }
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (warp == kConsumerWarps) {
    if (lane == 0) produce<T>(maps, s, ring, full, empty);
    return;
  }

  const int group = warp / 4, group_warp = warp % 4;
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

    // Phase A, block j: phi(k) in place (four threads per row), then warp w forms rows
    // 16 (w % 4) .. + 15 (d) and columns 32 (w / 4) .. + 31 of phi(k)^T [v, 1]: A = phi(k) read
    // transposed, B = v (rows 64 .. 127 of the slot), the tokens as the depth; warps 0-3 also
    // the ones column (z_j). The first item's barrier also orders the last item's reads of S'
    // before these writes.
    for (int j = 0; j < blocks; ++j) {
      const int slot = wait_item(first_item + j);
      const RingTile<T> kv{ring + slot * (kSlotBytes / 2)};
      features_in_place<T, 2, 4>(kv, threadIdx.x / 4, 2 * (threadIdx.x % 4), nullptr);
      sync_named(kConsumersBarrier, kConsumerThreads);
      const int row0 = 16 * group_warp, col0 = 32 * group;
      float acc[16] = {}, zacc[4] = {};
#pragma unroll
      for (int kk = 0; kk < kTile; kk += 16) {
        unsigned fa[4];
        load_matrices<true>(fa, kv.at(kk + (quad / 2) * 8 + row8, row0 + (quad % 2) * 8));
#pragma unroll
        for (int n = 0; n < 2; ++n) {
          unsigned fb[4];
          load_matrices<true>(
              fb, kv.at(kTile + kk + (quad % 2) * 8 + row8, col0 + 16 * n + (quad / 2) * 8));
          mma16816<T>(*reinterpret_cast<float(*)[4]>(&acc[8 * n]), fa, fb[0], fb[1]);
          mma16816<T>(*reinterpret_cast<float(*)[4]>(&acc[8 * n + 4]), fa, fb[2], fb[3]);
        }
        if (group == 0) mma16816<T>(zacc, fa, ones, ones);
      }
      release(slot);
      const StateTile<T> st = state_tile(j);
      const int d = row0 + g8;
#pragma unroll
      for (int n = 0; n < 4; ++n) {
        *reinterpret_cast<unsigned*>(st.at(d, col0 + 8 * n + c0)) =
            pack_pair<T>(acc[4 * n], acc[4 * n + 1]);
        *reinterpret_cast<unsigned*>(st.at(d + 8, col0 + 8 * n + c0)) =
            pack_pair<T>(acc[4 * n + 2], acc[4 * n + 3]);
      }
      if (group == 0 && lane % 4 == 0) {
        z[j * kD + d] = zacc[0];
        z[j * kD + d + 8] = zacc[2];
        state_set[j * kPackedFloats + kPackedZ + d] = zacc[0];
        state_set[j * kPackedFloats + kPackedZ + d + 8] = zacc[2];
      }
      // This warp's part of S_j leaves now, while the next item's copies are awaited.
      __syncwarp();
      copy_state_rows<T, 32>(st, row0, col0, state_set + j * kPackedFloats);
    }
    sync_named(kConsumersBarrier, kConsumerThreads);

    // S' = m S in place: warp w takes rows 8 w .. 8 w + 7 of every state, one row (eight
    // 16-byte pieces) per step, with the next row's four two-piece loads issued before this
    // row's eight product pairs and stores, so loads and products overlap (one piece at a time
    // left each product waiting on its load: 15,000 cycles per (batch, head), session 41).
    // Lane rows of the loads: state (quad % 2) * 8 + row8, piece quad / 2 of each pair.
    const int load_state = (quad % 2) * 8 + row8;
    const StateTile<T> load_tile = state_tile(load_state < blocks ? load_state : 0);
    const StateTile<T> low_tile = state_tile(g8 < blocks ? g8 : 0);
    const StateTile<T> high_tile = state_tile(g8 + 8 < blocks ? g8 + 8 : 0);
    auto load_row = [&](int d, unsigned(&fb)[4][4]) {
#pragma unroll
      for (int pair = 0; pair < 4; ++pair)
        load_matrices<true>(fb[pair], load_tile.at(d, 8 * (2 * pair + quad / 2)));
    };
    unsigned next[4][4];
    load_row(8 * warp, next);
#pragma unroll
    for (int step = 0; step < 8; ++step) {
      const int d = 8 * warp + step;
      unsigned fb[4][4];
#pragma unroll
      for (int pair = 0; pair < 4; ++pair)
#pragma unroll
        for (int r = 0; r < 4; ++r) fb[pair][r] = next[pair][r];
      // Every lane's read of row d comes before any lane's write of it (the products already
      // order them; the warp barrier says so to the race checker).
      __syncwarp();
      if (step + 1 < 8) load_row(d + 1, next);
#pragma unroll
      for (int pair = 0; pair < 4; ++pair) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float out[4] = {};
          mma16816<T>(out, m_hi, fb[pair][2 * e], fb[pair][2 * e + 1]);
          mma16816<T>(out, m_lo, fb[pair][2 * e], fb[pair][2 * e + 1]);
          const int col = 8 * (2 * pair + e) + c0;
          if (g8 < blocks)
            *reinterpret_cast<unsigned*>(low_tile.at(d, col)) = pack_pair<T>(out[0], out[1]);
          if (g8 + 8 < blocks)
            *reinterpret_cast<unsigned*>(high_tile.at(d, col)) = pack_pair<T>(out[2], out[3]);
        }
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

    // Phase C, query tiles 2u and 2u + 1: phi(q) in place and den (two threads per row of both
    // tiles), then warpgroup g forms tile 2u + g's outputs, warp w its rows 16 (w % 4) .. + 15.
    for (int u = 0; u < query_items; ++u) {
      const int slot = wait_item(first_item + blocks + u);
      const RingTile<T> qt{ring + slot * (kSlotBytes / 2)};
      float* const item_den = den + (u % 2) * 2 * kTile;
      const int row = threadIdx.x / 2, block_of_row = 2 * u + row / kTile;
      if (block_of_row < blocks) {
        const float part =
            features_in_place<T, 4, 2>(qt, row, 4 * (threadIdx.x % 2), zm + block_of_row * kD);
        const float total = part + __shfl_xor_sync(0xffffffffu, part, 1);
        if (threadIdx.x % 2 == 0) item_den[row] = total;
      }
      // Warp w made the features of rows 16 w .. + 15, which are the rows it takes below
      // (64 g + 16 (w % 4)): no other warp reads them.
      __syncwarp();
      const int i = 2 * u + group;
      if (i < blocks) {
        const int row0 = kTile * group + 16 * group_warp;
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
        copy_state_rows<T, kD>(st, 16 * group_warp, 0, mixed_set + i * kPackedFloats);
        if (group_warp == 0) {
          const float2 pair = *reinterpret_cast<const float2*>(zm + i * kD + 2 * lane);
          *reinterpret_cast<float2*>(mixed_set + i * kPackedFloats + kPackedZ + 2 * lane) = pair;
        }
      }
      if (lane == 0) tc::wait_stores_read();
      release(slot);
    }
    // The next (batch, head)'s copies land in slots whose rows this one's warps wrote (phi(q),
    // outputs) and read: the slots' barriers order them, through the producer; this barrier
    // orders them directly, for the race checker, at one barrier per (batch, head). (The first
    // item's barrier would order the state writes.)
    sync_named(kConsumersBarrier, kConsumerThreads);
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
