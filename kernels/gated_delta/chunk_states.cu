// The sequential passes of the fused gated DeltaNet: the state carried from chunk to chunk
// (forward) and its gradient carried back (backward). One CTA per (32 value columns, batch x
// head) walks the chunks. Its [D, 32] slice of the state lives in fp32 tensor-core accumulators
// in registers for the whole walk, with an element-type copy in shared memory as the operand of
// the next chunk's first product; the next chunk's tiles (from the parallel passes and the
// inputs) load asynchronously while the current chunk computes (into a second buffer, or for the
// backward's big tiles on large grids into the same one as soon as it is read: BackwardLayout).
//   forward:  store S_i;  u = U0 - W S_i;  S_{i+1} = exp(G_C) S_i + K^T diag(exp(G_C - G)) u
//   backward: store dS_{i+1};  du = scale P^T dO + diag(exp(G_C - G)) K dS_{i+1};
//             dS_i = exp(G_C) dS_{i+1} + [Q ; W]^T [diag(scale exp(G)) dO ; -du]
// The local part of du (through the chunk's own outputs, P^T dO with the decayed causal scores P
// the forward kept) is a product of this walk too: it needs no state, but forming it here saves
// a pass and an fp32 [64, D] round trip per chunk through global memory.
// KDA (PerKey) runs the same walks with exp(G_C) a per-row (key dimension) decay and the gated
// operands its prepare pass kept: exp(G_C - G) . K for K with its decay, exp(G) . Q for Q.
#include "common/device_info.h"
#include "common/packed_access.cuh"
#include "gated_delta/chunk_passes.h"
#include "gated_delta/chunk_tiles.cuh"

#include <algorithm>
#include <cstdlib>

namespace mhla_kernels {
namespace gated_delta {
namespace {

constexpr int kThreads = 256;  // 8 warps: short chains of products per chunk
constexpr int kWarps = kThreads / 32;
// Each CTA walks a slice of Slice value columns (32, or 16 when 32-column slices would leave
// most SMs idle: long sequences, few batch x head pairs).
template <int Slice>
struct SliceLd {
  static constexpr int e = Slice + 8;  // element-type rows of the slice
  // fp32 rows of the slice: a padding of 8 (see Ld) would push the forward walk past two CTAs
  // per SM.
  static constexpr int f = Slice + 4;
};

// The state slice [D][32] as 16 x 16 accumulator tiles held in registers across chunks: warp w
// owns tiles w, w + 8, ... (tile f at rows 16 (f / 2), columns 16 (f % 2)).
template <typename T, int D, int Slice>
struct StateFragments {
  static constexpr int kPerWarp = (D / 16) * (Slice / 16) / kWarps;
  static_assert(kPerWarp >= 1, "every warp holds a tile");
  wmma_tiles::TileAccumulator f[kPerWarp];
  __device__ static int tile_row(int j) { return (threadIdx.x / 32 + kWarps * j) / (Slice / 16); }
  __device__ static int tile_col(int j) { return (threadIdx.x / 32 + kWarps * j) % (Slice / 16); }
  __device__ void load(const float* s) {
#pragma unroll
    for (int j = 0; j < kPerWarp; ++j) {
      f[j].load(s + 16 * tile_row(j) * SliceLd<Slice>::f + 16 * tile_col(j), SliceLd<Slice>::f);
    }
  }
  __device__ void store(float* s) const {
#pragma unroll
    for (int j = 0; j < kPerWarp; ++j) {
      f[j].store(s + 16 * tile_row(j) * SliceLd<Slice>::f + 16 * tile_col(j), SliceLd<Slice>::f);
    }
  }
  // The element-type copy that is the next chunk's product operand, straight from the
  // registers (no fp32 staging round trip on the walk's critical path).
  __device__ void store_elements(T* s) const {
#pragma unroll
    for (int j = 0; j < kPerWarp; ++j) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int r = 16 * tile_row(j) + wmma_tiles::TileAccumulator::row(i);
          const int c = 16 * tile_col(j) + wmma_tiles::TileAccumulator::col(h, i);
          s[r * SliceLd<Slice>::e + c] = from_float<T>(f[j].x[h][i]);
        }
      }
    }
  }
  // Calls visit(first, second, offset) for each pair of adjacent columns a thread holds, with
  // the pair's offset in a [D, D] matrix whose slice starts at column col0.
  template <typename Fragments, typename Visit>
  __device__ static void each_pair(Fragments& fragments, int col0, Visit visit) {
#pragma unroll
    for (int j = 0; j < kPerWarp; ++j) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int i = 0; i < 4; i += 2) {
          const int r = 16 * tile_row(j) + wmma_tiles::TileAccumulator::row(i);
          const int c = col0 + 16 * tile_col(j) + wmma_tiles::TileAccumulator::col(h, i);
          visit(fragments[j].x[h][i], fragments[j].x[h][i + 1], static_cast<int64_t>(r) * D + c);
        }
      }
    }
  }
  // The slice straight from / to a global fp32 [D, D] matrix (columns col0 on; src null: zeros).
  __device__ void load_global(const float* src, int col0) {
    each_pair(f, col0, [&](float& a, float& b, int64_t at) {
      const float2 v =
          src != nullptr ? *reinterpret_cast<const float2*>(src + at) : make_float2(0.f, 0.f);
      a = v.x, b = v.y;
    });
  }
  __device__ void store_global(float* dst, int col0) const {
    each_pair(f, col0, [&](const float& a, const float& b, int64_t at) {
      *reinterpret_cast<float2*>(dst + at) = make_float2(a, b);
    });
  }
  // f += A^T B for A [Depth][D] (rows lda apart) and B [Depth][32] (rows ldb apart).
  __device__ void add(const T* a, int lda, const T* b, int ldb, int depth) {
#pragma unroll
    for (int j = 0; j < kPerWarp; ++j) {
      wmma_tiles::mma_tile<T, true, false>(f[j], a, lda, b, ldb, tile_row(j), tile_col(j), depth);
    }
  }
  // f = diag(decay) f + A^T B for A [Depth][D] (rows lda apart) and B [Depth][32] (rows ldb
  // apart); decay[row] per state row, or one decay for all rows (decay[0]) unless PerRow.
  template <bool PerRow>
  __device__ void decay_and_add(const float* decay, const T* a, int lda, const T* b, int ldb,
                                int depth) {
#pragma unroll
    for (int j = 0; j < kPerWarp; ++j) {
      if constexpr (PerRow) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            f[j].x[h][i] *= decay[16 * tile_row(j) + wmma_tiles::TileAccumulator::row(i)];
          }
        }
      } else {
        f[j].scale(decay[0]);
      }
      wmma_tiles::mma_tile<T, true, false>(f[j], a, lda, b, ldb, tile_row(j), tile_col(j), depth);
    }
  }
};

// Shared-memory layouts (byte offsets). The next chunk's tiles load into the other stage while
// the current chunk computes; the fp32 staging tile also holds the first product's result.
template <int D, int Slice>
struct ForwardLayout {
  static constexpr size_t staging = 0;                                   // f32 [D][36]
  static constexpr size_t to_end = staging + 4 * D * SliceLd<Slice>::f;  // f32 [64]
  static constexpr size_t row_decay = to_end + 4 * kC;                   // f32 [D]: exp(G_C)
  static constexpr size_t s_bf = row_decay + 4 * D;                      // [D][40]
  static constexpr size_t us_bf = s_bf + 2 * D * SliceLd<Slice>::e;      // [64][40]
  static constexpr size_t stage0 = us_bf + 2 * kC * SliceLd<Slice>::e;
  static constexpr size_t w = 0, k = w + 2 * kC * Ld<D>::e, u0 = k + 2 * kC * Ld<D>::e,
                          g = u0 + 2 * kC * SliceLd<Slice>::e,
                          stage_bytes = g + 4 * (kC > D ? kC : D);
  static constexpr size_t bytes = stage0 + 2 * stage_bytes;
  static_assert(2 * (bytes + 1024) <= 228 * 1024, "two CTAs per SM");
};

// Two ways to buffer the backward walk's big tiles (Q, W, K, P), BigBuffers:
//   1: one buffer each, the next chunk's copy issued as soon as the current chunk has finished
//      reading it, so that two CTAs fit an SM (one walk's chain of dependent products leaves the
//      SM idle between them otherwise); taken when the grid has more CTAs than the GPU has SMs;
//   2: two buffers, every copy of the next chunk issued at the top of the current one (a whole
//      chunk of latency to hide); taken for small grids (long sequences, few batch x heads),
//      where pairing CTAs has nothing to pair.
// dO and the gate sums, read from the first phase to the last, always have two.
template <int D, int Slice, int BigBuffers>
struct BackwardLayout {
  static constexpr size_t staging = 0;                                   // f32 [64][36]: K dS
  static constexpr size_t local = staging + 4 * kC * SliceLd<Slice>::f;  // f32 [64][36]: P^T dO
  static constexpr size_t to_end = local + 4 * kC * SliceLd<Slice>::f;
  static constexpr size_t decay = to_end + 4 * kC;                     // f32 [64]: scale exp(G_r)
  static constexpr size_t row_decay = decay + 4 * kC;                  // f32 [D]: exp(G_C)
  static constexpr size_t ds_bf = row_decay + 4 * D;                   // [D][40]
  static constexpr size_t du_neg = ds_bf + 2 * D * SliceLd<Slice>::e;  // [64][40]
  static constexpr size_t big0 = du_neg + 2 * kC * SliceLd<Slice>::e;
  static constexpr size_t q = 0, w = q + 2 * kC * Ld<D>::e, k = w + 2 * kC * Ld<D>::e,
                          scores = k + 2 * kC * Ld<D>::e,  // [64][72]: P
      big_bytes = scores + 2 * kC * kLdSquareE;
  static constexpr size_t stage0 = big0 + BigBuffers * big_bytes;
  static constexpr size_t d_out = 0, g = d_out + 2 * kC * SliceLd<Slice>::e,
                          stage_bytes = g + 4 * (kC > D ? kC : D);
  static constexpr size_t bytes = stage0 + 2 * stage_bytes;
  static_assert(BigBuffers == 2 || 2 * (bytes + 1024) <= 228 * 1024, "two CTAs per SM");
};

// The state slice from global fp32 [D, D] (or zeros) into fp32 shared memory.
template <int D, int Slice>
__device__ void load_state_slice(float* s, const float* src, int col0) {
  for (int e = threadIdx.x; e < D * Slice; e += kThreads) {
    const int r = e / Slice, c = e % Slice;
    s[r * SliceLd<Slice>::f + c] =
        src != nullptr ? src[static_cast<int64_t>(r) * D + col0 + c] : 0.f;
  }
}

template <int D, int Slice>
__device__ void store_state_slice(float* dst, const float* s, int col0) {
  for (int e = threadIdx.x; e < D * Slice; e += kThreads) {
    const int r = e / Slice, c = e % Slice;
    dst[static_cast<int64_t>(r) * D + col0 + c] = s[r * SliceLd<Slice>::f + c];
  }
}

// The chunk's gate sums G [64] (gated DeltaNet), or for KDA (PerKey) the last row G_C [D] of its
// [64][D] tile: all the walks need of it.
template <bool PerKey, int D>
__device__ __forceinline__ void copy_gate_sums_async(float* g, const GatedDeltaArgs& p, int bh,
                                                     int chunks, int i) {
  const int64_t chunk = static_cast<int64_t>(bh) * chunks + i;
  const float* src = PerKey ? p.gate_sums + (chunk * kC + kC - 1) * D : p.gate_sums + chunk * kC;
  if (threadIdx.x < (PerKey ? D : kC) / 4)
    copy_async16(g + 4 * threadIdx.x, src + 4 * threadIdx.x, true);
}

template <typename T, int D, bool PerKey, int Slice>
__global__ void __launch_bounds__(kThreads, 2) states_forward_kernel(GatedDeltaArgs p) {
  using L = ForwardLayout<D, Slice>;
  extern __shared__ __align__(128) unsigned char raw[];
  float* staging = reinterpret_cast<float*>(raw + L::staging);  // S, or W S
  float* to_end = reinterpret_cast<float*>(raw + L::to_end);
  float* row_decay = reinterpret_cast<float*>(raw + L::row_decay);
  T* s_bf = reinterpret_cast<T*>(raw + L::s_bf);
  T* us_bf = reinterpret_cast<T*>(raw + L::us_bf);  // diag(exp(G_C - G)) u
  auto stage = [&](int s, size_t part) { return raw + L::stage0 + s * L::stage_bytes + part; };
  const int bh = blockIdx.y, col0 = blockIdx.x * Slice;
  const int chunks = gated_delta_chunks(p.tokens);
  const int first = p.chunk_begin, last = range_end(p);  // this walk's chunks (a segment)
  const T* w = static_cast<const T*>(p.w);
  const T* k = static_cast<const T*>(PerKey ? p.k_to_end : p.k);
  const T* u0 = static_cast<const T*>(p.u0);
  const int b = bh / p.heads, h = bh % p.heads;
  auto issue = [&](int i, int s) {
    const ChunkPosition at(p, bh, b, h, i);
    copy_strided_rows_async<T, D, kThreads>(reinterpret_cast<T*>(stage(s, L::w)), Ld<D>::e,
                                            w + at.tile(0, D), D, kC);
    if constexpr (PerKey) {  // exp(G_C - G) . K, a per-chunk tile
      copy_strided_rows_async<T, D, kThreads>(reinterpret_cast<T*>(stage(s, L::k)), Ld<D>::e,
                                              k + at.tile(0, D), D, kC);
    } else {
      copy_strided_rows_async<T, D, kThreads>(reinterpret_cast<T*>(stage(s, L::k)), Ld<D>::e,
                                              k + at.token(0, D, p.heads, p.tokens), p.heads * D,
                                              at.valid);
    }
    copy_strided_rows_async<T, Slice, kThreads>(
        reinterpret_cast<T*>(stage(s, L::u0)), SliceLd<Slice>::e, u0 + at.tile(0, D) + col0, D, kC);
    copy_gate_sums_async<PerKey, D>(reinterpret_cast<float*>(stage(s, L::g)), p, bh, chunks, i);
    copy_async_commit();
  };
  issue(first, 0);
  const int64_t state0 = static_cast<int64_t>(bh) * D * D;
  load_state_slice<D, Slice>(staging, p.initial_state ? p.initial_state + state0 : nullptr, col0);
  __syncthreads();
  StateFragments<T, D, Slice> state;
  state.load(staging);
  convert_tile<T, D, Slice, kThreads>(s_bf, SliceLd<Slice>::e, staging, SliceLd<Slice>::f);
  for (int i = first; i < last; ++i) {
    const int s = (i - first) & 1;
    const ChunkPosition at(p, bh, b, h, i);
    copy_async_wait<0>();
    __syncthreads();  // chunk i's tiles are in; s_bf holds S_i
    // The other buffer's readers (chunk i - 1's last product) passed the barrier: issuing before
    // it could overwrite K under a slower warp.
    if (i + 1 < last) issue(i + 1, s ^ 1);
    const T* w_s = reinterpret_cast<const T*>(stage(s, L::w));
    const T* k_s = reinterpret_cast<const T*>(stage(s, L::k));
    const T* u0_s = reinterpret_cast<const T*>(stage(s, L::u0));
    const float* g = reinterpret_cast<const float*>(stage(s, L::g));
    store_matrix<T, D, Slice, kThreads>(static_cast<T*>(p.states) + at.state(D) + col0, D, s_bf,
                                        SliceLd<Slice>::e);
    if constexpr (PerKey) {
      if (threadIdx.x < kC) to_end[threadIdx.x] = 1.f;  // in the keys already
      if (threadIdx.x < D) row_decay[threadIdx.x] = __expf(g[threadIdx.x]);
    } else {
      if (threadIdx.x < kC) to_end[threadIdx.x] = __expf(g[kC - 1] - g[threadIdx.x]);
      if (threadIdx.x == 0) row_decay[0] = __expf(g[kC - 1]);
    }
    gemm<T, kWarps, false, false>(w_s, Ld<D>::e, s_bf, SliceLd<Slice>::e, staging,
                                  SliceLd<Slice>::f, kC, Slice, D, false);
    __syncthreads();
    T* u_out = static_cast<T*>(p.u) + at.tile(0, D) + col0;
    for (int e = threadIdx.x; e < kC * Slice / 4; e += kThreads) {  // 4 columns a thread
      const int r = e / (Slice / 4), c = 4 * (e % (Slice / 4));
      float u[4], us[4];
      load_pack<T, 4>(u0_s + r * SliceLd<Slice>::e + c, u);
      const float4 ws = *reinterpret_cast<const float4*>(staging + r * SliceLd<Slice>::f + c);
      u[0] -= ws.x, u[1] -= ws.y, u[2] -= ws.z, u[3] -= ws.w;
#pragma unroll
      for (int j = 0; j < 4; ++j) us[j] = to_end[r] * u[j];
      store_pack<T, 4>(u_out + r * D + c, u);
      store_pack<T, 4>(us_bf + r * SliceLd<Slice>::e + c, us);
    }
    __syncthreads();
    // S_{i+1} = exp(G_C) S_i + K^T diag(exp(G_C - G)) u, in the registers.
    state.template decay_and_add<PerKey>(row_decay, k_s, Ld<D>::e, us_bf, SliceLd<Slice>::e, kC);
    state.store_elements(s_bf);  // its readers (the S_i store, W S_i) finished before the u pass
  }
  state.store(staging);
  __syncthreads();
  store_state_slice<D, Slice>(p.final_state + state0, staging, col0);
}

template <typename T, int D, bool PerKey, int Slice, int BigBuffers>
__global__ void __launch_bounds__(kThreads, 3 - BigBuffers)
    states_backward_kernel(GatedDeltaArgs p) {
  using L = BackwardLayout<D, Slice, BigBuffers>;
  constexpr bool kPaired = BigBuffers == 1;
  extern __shared__ __align__(128) unsigned char raw[];
  float* staging = reinterpret_cast<float*>(raw + L::staging);
  float* local = reinterpret_cast<float*>(raw + L::local);
  float* to_end = reinterpret_cast<float*>(raw + L::to_end);
  float* decay = reinterpret_cast<float*>(raw + L::decay);
  float* row_decay = reinterpret_cast<float*>(raw + L::row_decay);
  T* ds_bf = reinterpret_cast<T*>(raw + L::ds_bf);
  T* du_neg = reinterpret_cast<T*>(raw + L::du_neg);
  auto stage = [&](int s, size_t part) { return raw + L::stage0 + s * L::stage_bytes + part; };
  auto big = [&](int s, size_t part) {
    return reinterpret_cast<T*>(raw + L::big0 + (kPaired ? 0 : s * L::big_bytes) + part);
  };
  const int bh = blockIdx.y, col0 = blockIdx.x * Slice;
  const int chunks = gated_delta_chunks(p.tokens);
  const int first = p.chunk_begin, last = range_end(p);  // this walk's chunks (a segment)
  const T* q = static_cast<const T*>(PerKey ? p.q_gated : p.q);
  const T* w = static_cast<const T*>(p.w);
  const T* k = static_cast<const T*>(PerKey ? p.k_to_end : p.k);
  const T* d_out = static_cast<const T*>(p.d_out);
  const T* p_scores = static_cast<const T*>(p.scores);
  const int b = bh / p.heads, h = bh % p.heads;
  // Q and K rows: KDA's gated per-chunk tiles, or gated DeltaNet's raw tokens.
  auto copy_rows = [&](T* dst, const T* base, const ChunkPosition& at) {
    if constexpr (PerKey) {
      copy_strided_rows_async<T, D, kThreads>(dst, Ld<D>::e, base + at.tile(0, D), D, kC);
    } else {
      copy_strided_rows_async<T, D, kThreads>(
          dst, Ld<D>::e, base + at.token(0, D, p.heads, p.tokens), p.heads * D, at.valid);
    }
  };
  // Three commit groups per chunk i into buffer s, in this order (i < first: empty groups keep the
  // count): dO and G, K and P, Q and W. Paired: at the top of chunk i + 1, once its first phase is
  // done with K and P, and at its end; otherwise all three at the top of chunk i + 1.
  auto issue_rows = [&](int i, int s) {
    if (i >= first) {
      const ChunkPosition at(p, bh, b, h, i);
      copy_strided_rows_async<T, Slice, kThreads>(
          reinterpret_cast<T*>(stage(s, L::d_out)), SliceLd<Slice>::e,
          d_out + at.token(0, D, p.heads, p.tokens) + col0, p.heads * D, at.valid);
      copy_gate_sums_async<PerKey, D>(reinterpret_cast<float*>(stage(s, L::g)), p, bh, chunks, i);
    }
    copy_async_commit();
  };
  auto issue_keys = [&](int i, int s) {
    if (i >= first) {
      const ChunkPosition at(p, bh, b, h, i);
      copy_rows(big(s, L::k), k, at);
      copy_strided_rows_async<T, kC, kThreads>(big(s, L::scores), kLdSquareE,
                                               p_scores + at.tile(0, kC), kC, kC);
    }
    copy_async_commit();
  };
  auto issue_queries = [&](int i, int s) {
    if (i >= first) {
      const ChunkPosition at(p, bh, b, h, i);
      copy_rows(big(s, L::q), q, at);
      copy_strided_rows_async<T, D, kThreads>(big(s, L::w), Ld<D>::e, w + at.tile(0, D), D, kC);
    }
    copy_async_commit();
  };
  issue_rows(last - 1, 0);
  issue_keys(last - 1, 0);
  issue_queries(last - 1, 0);
  const int64_t state0 = static_cast<int64_t>(bh) * D * D;
  StateFragments<T, D, Slice> grad;
  grad.load_global(p.final_state_grad ? p.final_state_grad + state0 : nullptr, col0);
  grad.store_elements(ds_bf);
  for (int step = 0; step < last - first; ++step) {
    const int i = last - 1 - step, s = step & 1;
    const ChunkPosition at(p, bh, b, h, i);
    // Paired: dO, G, K and P of chunk i are in (Q and W may still be in flight); otherwise all.
    if constexpr (kPaired) {
      copy_async_wait<1>();
    } else {
      copy_async_wait<0>();
    }
    __syncthreads();  // ... for every thread; ds_bf holds dS_{i+1}
    // The other buffers' readers (chunk i + 1) passed the barrier.
    issue_rows(i - 1, s ^ 1);
    if constexpr (!kPaired) {
      issue_keys(i - 1, s ^ 1);
      issue_queries(i - 1, s ^ 1);
    }
    const T* k_s = big(s, L::k);
    const T* scores = big(s, L::scores);
    const T* q_s = big(s, L::q);
    const T* w_s = big(s, L::w);
    T* do_s = reinterpret_cast<T*>(stage(s, L::d_out));
    const float* g = reinterpret_cast<const float*>(stage(s, L::g));
    store_matrix<T, D, Slice, kThreads>(static_cast<T*>(p.state_grads) + at.state(D) + col0, D,
                                        ds_bf, SliceLd<Slice>::e);
    if constexpr (PerKey) {  // the decays are in the gated tiles; exp(G_C) by state row
      if (threadIdx.x < kC) {
        to_end[threadIdx.x] = 1.f;
        decay[threadIdx.x] = p.scale;
      }
      if (threadIdx.x < D) row_decay[threadIdx.x] = __expf(g[threadIdx.x]);
    } else {
      if (threadIdx.x < kC) {
        to_end[threadIdx.x] = __expf(g[kC - 1] - g[threadIdx.x]);
        decay[threadIdx.x] = p.scale * __expf(g[threadIdx.x]);
      }
      if (threadIdx.x == 0) row_decay[0] = __expf(g[kC - 1]);
    }
    gemm<T, kWarps, false, false>(k_s, Ld<D>::e, ds_bf, SliceLd<Slice>::e, staging,
                                  SliceLd<Slice>::f, kC, Slice, D, false);
    gemm<T, kWarps, true, false>(scores, kLdSquareE, do_s, SliceLd<Slice>::e, local,
                                 SliceLd<Slice>::f, kC, Slice, kC, false);  // P^T dO, unscaled
    __syncthreads();
    if constexpr (kPaired) issue_keys(i - 1, 0);  // K and P of this chunk are done with
    T* du_out = static_cast<T*>(p.du) + at.tile(0, D) + col0;
    for (int e = threadIdx.x; e < kC * Slice / 4; e += kThreads) {  // 4 columns a thread
      const int r = e / (Slice / 4), c = 4 * (e % (Slice / 4));
      const float4 pl = *reinterpret_cast<const float4*>(local + r * SliceLd<Slice>::f + c);
      const float4 kd = *reinterpret_cast<const float4*>(staging + r * SliceLd<Slice>::f + c);
      const float lp[4] = {pl.x, pl.y, pl.z, pl.w}, ks[4] = {kd.x, kd.y, kd.z, kd.w};
      float du[4], du_minus[4], dout[4];
      T* x = do_s + r * SliceLd<Slice>::e + c;
      load_pack<T, 4>(x, dout);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        du[j] = p.scale * lp[j] + to_end[r] * ks[j];
        du_minus[j] = -du[j];
        dout[j] *= decay[r];  // (exp(G) . Q)^T dO' as Q^T (scale exp(G) . dO)
      }
      store_pack<T, 4>(du_out + r * D + c, du);
      store_pack<T, 4>(du_neg + r * SliceLd<Slice>::e + c, du_minus);
      store_pack<T, 4>(x, dout);
    }
    // Paired: Q and W of chunk i (the rows and keys of chunk i - 1 may be pending).
    if constexpr (kPaired) copy_async_wait<2>();
    __syncthreads();
    // dS_i = exp(G_C) dS_{i+1} + Q^T (scale exp(G) . dO) - W^T du, in the registers.
    grad.template decay_and_add<PerKey>(row_decay, q_s, Ld<D>::e, do_s, SliceLd<Slice>::e, kC);
    grad.add(w_s, Ld<D>::e, du_neg, SliceLd<Slice>::e, kC);
    grad.store_elements(ds_bf);  // its readers (the dS store, K dS) finished before the du pass
    if constexpr (kPaired) {
      __syncthreads();  // Q and W's readers are done
      issue_queries(i - 1, 0);
    }
  }
  if (p.initial_state_grad != nullptr) grad.store_global(p.initial_state_grad + state0, col0);
}

// 16-column slices where 32-column ones would fill fewer than half the GPU's SMs (D = 128 only:
// at D = 64 a 16-column slice is too small to give every warp a tile). On the H200 at B*T =
// 32,768, H = 8: T = 32,768 (32 CTAs) gated DeltaNet 5.33 -> 4.45 ms forward+backward, KDA 6.72
// -> 5.79; at T = 8,192 (128 CTAs) 16 columns were slower (2.88 -> 3.09 ms).
// MHLA_DELTA_STATE_SLICE=16|32 forces one.
inline int state_slice(const GatedDeltaArgs& a) {
  if (a.head_dim != 128) return 32;
  if (const char* forced = std::getenv("MHLA_DELTA_STATE_SLICE")) {
    return std::atoi(forced) == 16 ? 16 : 32;
  }
  return 2 * a.batch * a.heads * (a.head_dim / 32) < multiprocessors() ? 16 : 32;
}

// The backward walk's buffering (BackwardLayout): paired CTAs where the grid has more CTAs than
// the GPU has SMs. On the H200 at B*T = 32,768, H = 8, D = 128: T = 2,048 (512 CTAs) gated
// DeltaNet 2.02 -> 1.94 ms forward+backward paired; T = 8,192 (128 CTAs) 2.06 -> 2.13 paired.
// MHLA_DELTA_WALK_BUFFERS=1|2 forces one (the tests run both).
inline int walk_big_buffers(dim3 grid) {
  if (const char* forced = std::getenv("MHLA_DELTA_WALK_BUFFERS")) {
    return std::atoi(forced) == 1 ? 1 : 2;
  }
  return static_cast<int>(grid.x * grid.y) > multiprocessors() ? 1 : 2;
}

// Pipelined walks (gated_delta_walk_segments): cut into up to kMaxWalkSegments segments of at
// least kMinSegmentChunks chunks (a boundary costs a launch and an fp32 state round trip) where
// the walk leaves at least half the SMs free for the per-chunk passes. With fewer free SMs they
// gained nothing: the chunk-gradient pass fits no SM beside a walk CTA, and an output CTA fits
// beside a forward walk CTA but did not speed it up (H200, B*T = 32,768, H = 8, D = 128:
// T = 8,192, 128 walk CTAs, gated DeltaNet 1.925 -> 1.953 ms forward+backward with the forward
// in 8 segments; T = 32,768, 64 CTAs, 3.341 -> 2.644 with both walks in 8).
constexpr int kMaxWalkSegments = 8;
constexpr int kMinSegmentChunks = 16;

int segments_for(const GatedDeltaArgs& a) {
  const int chunks = gated_delta_chunks(a.tokens);
  if (const char* forced = std::getenv("MHLA_DELTA_WALK_SEGMENTS")) {
    return std::max(1, std::min(std::atoi(forced), chunks));
  }
  const int walk_ctas = a.batch * a.heads * (a.head_dim / state_slice(a));
  if (2 * walk_ctas > multiprocessors()) return 1;
  return std::max(1, std::min(kMaxWalkSegments, chunks / kMinSegmentChunks));
}

template <typename T, int D, int Slice, int BigBuffers>
cudaError_t launch_backward(const GatedDeltaArgs& a, dim3 grid, cudaStream_t stream) {
  constexpr size_t bytes = BackwardLayout<D, Slice, BigBuffers>::bytes;
  return a.per_key_gate ? launch_pass(states_backward_kernel<T, D, true, Slice, BigBuffers>, grid,
                                      kThreads, bytes, a, stream)
                        : launch_pass(states_backward_kernel<T, D, false, Slice, BigBuffers>, grid,
                                      kThreads, bytes, a, stream);
}

template <typename T, int D, int Slice, bool Forward>
cudaError_t launch_walk(const GatedDeltaArgs& a, cudaStream_t stream) {
  const dim3 grid(D / Slice, a.batch * a.heads);
  if constexpr (Forward) {
    constexpr size_t bytes = ForwardLayout<D, Slice>::bytes;
    return a.per_key_gate ? launch_pass(states_forward_kernel<T, D, true, Slice>, grid, kThreads,
                                        bytes, a, stream)
                          : launch_pass(states_forward_kernel<T, D, false, Slice>, grid, kThreads,
                                        bytes, a, stream);
  } else if (walk_big_buffers(grid) == 1) {
    return launch_backward<T, D, Slice, 1>(a, grid, stream);
  } else {
    return launch_backward<T, D, Slice, 2>(a, grid, stream);
  }
}

template <bool Forward>
struct Walk {
  template <typename T, int D>
  struct Pass {
    static cudaError_t launch(const GatedDeltaArgs& a, cudaStream_t stream) {
      if constexpr (D == 128) {
        if (state_slice(a) == 16) return launch_walk<T, D, 16, Forward>(a, stream);
      }
      return launch_walk<T, D, 32, Forward>(a, stream);
    }
  };
};

}  // namespace

int walk_segments(const GatedDeltaArgs& a) {
  return segments_for(a);
}

cudaError_t run_states_forward(const GatedDeltaArgs& a, cudaStream_t stream) {
  return dispatch<Walk<true>::Pass>(a, stream);
}

cudaError_t run_states_backward(const GatedDeltaArgs& a, cudaStream_t stream) {
  return dispatch<Walk<false>::Pass>(a, stream);
}

}  // namespace gated_delta
}  // namespace mhla_kernels
