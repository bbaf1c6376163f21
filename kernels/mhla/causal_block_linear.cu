// Causal block linear attention (causal linear attention and causal MHLA), forward and backward.
// One CTA per (batch*head, 64-token block) for the token passes (for 16-bit types the lean ones,
// two or three CTAs per SM, below the original passes that fp32 keeps); the prefix passes sweep
// the blocks of one sequence per state element. See causal_block_linear.h for the math and the
// packed prefix sets.
#include <algorithm>
#include <cstdlib>
#include <type_traits>
#include <utility>

#include "common/async_copy.cuh"
#include "common/device_info.h"
#include "common/packed_access.cuh"
#include "mhla/causal_block_linear.h"
#include "mhla/state_tiles.cuh"
#include "mhla/tiles.cuh"

namespace mhla_kernels {
namespace {

using namespace tiles;

constexpr int kC = kCausalBlockTokens;
// 16 warps per CTA: the token passes hold one 64-token block per CTA at one CTA per SM, so their
// loads and products only overlap across warps (at T = 2,048, B*T = 32,768, D = 128, 256 -> 512
// threads took causal linear attention from 2.16 to 1.92 ms forward+backward, MHLA from 2.60
// to 2.33; the bidirectional kernels were slower with 512 and keep tiles::kThreads).
constexpr int kCausalThreads = 512;
constexpr int kCausalWarps = kCausalThreads / 32;
// The prefix sweeps (one state element per thread, a window of states per thread in shared
// memory or registers) keep 256 threads.
constexpr int kSweepThreads = 256;
// The register-window sweeps keep this many blocks' loads in flight per thread (in shared-memory
// rings, filled by cp.async): each thread walks its elements through the blocks one after the
// other, so the sweeps are bound by load latency unless many loads are in flight. Session 21
// kept them in registers, where more than 1 (forward) or 4 (backward) cost occupancy that the
// window needs (backward sweep 422 / 688 us at 4 / 16 blocks).
constexpr int kSweepAhead = 7;
constexpr size_t kMaxSharedBytes = 227 * 1024;  // tokens per block (== kTile: one tile per block)
constexpr int kLdScore = kC + 8;   // fp32 64 x 64 tiles (8-bank row stride: see gated_delta Ld)
constexpr int kLdScoreE = kC + 8;  // 64 x 64 tiles of tensor-core elements
static_assert(kC == kTile, "one shared-memory tile per causal block");

// The CTA-wide tensor-core product of kernels/common/wmma_gemm.cuh with this file's warps.
template <typename T, bool TransA, bool TransB>
__device__ void gemm(const typename Mma<T>::elem* a, int lda, const typename Mma<T>::elem* b,
                     int ldb, float* c, int ldc, int m, int n, int k, bool accumulate) {
  // Bigger tile blocks on half the warps (as the gated-delta passes: shared-memory bound).
  wmma_tiles::gemm_blocked<T, kCausalWarps, TransA, TransB, kCausalWarps / 2>(
      a, lda, b, ldb, c, ldc, m, n, k, accumulate);
}

__host__ __device__ constexpr int blocks_of(int tokens) {
  return (tokens + kC - 1) / kC;
}

// f(std::integral_constant<int, 0>), ..., f(std::integral_constant<int, N - 1>): loop bodies
// whose index must be a constant (register arrays indexed by it).
template <int N, typename F, int... I>
__device__ __forceinline__ void unrolled_impl(F&& f, std::integer_sequence<int, I...>) {
  (f(std::integral_constant<int, I>{}), ...);
}
template <int N, typename F>
__device__ __forceinline__ void unrolled(F&& f) {
  unrolled_impl<N>(f, std::make_integer_sequence<int, N>{});
}

// The weights w_ij of the header (m == nullptr: linear attention, all ones). The prefix passes
// read them through a shared-memory copy (RowWeights) in their inner loops.
struct CausalWeights {
  const float* m;
  int M;
  __device__ __forceinline__ float at(int i, int j) const {
    if (m == nullptr) return 1.f;
    if (i < M) return m[i * M + j];
    const int c = j - i + M - 1;
    return m[(M - 1) * M + (c > 0 ? c : 0)];
  }
  __device__ __forceinline__ float tail() const { return m == nullptr ? 1.f : m[(M - 1) * M]; }
  // Earlier blocks read with their own weight (the sliding window); older ones go through tail().
  __device__ __forceinline__ int window() const { return m == nullptr ? 0 : M - 1; }
  // Where the gradient of w_ii goes in the learned matrix.
  __device__ __forceinline__ int diagonal_index(int i) const {
    return i < M ? i * M + i : (M - 1) * M + M - 1;
  }
};

// A query-pass CTA's (grid (blocks, batch * heads)) sum of dm_ii over its block: added into
// grad_mixing, or stored as its part where the caller sums the parts in order
// (CausalBlockLinearBackward::diagonal_parts).
__device__ __forceinline__ void add_diagonal_grad(const CausalBlockLinearBackward& p,
                                                  const CausalWeights& mix, int block, float sum) {
  if (p.diagonal_parts != nullptr) {
    p.diagonal_parts[static_cast<size_t>(blockIdx.y) * gridDim.x + blockIdx.x] = sum;
  } else {
    atomicAdd(p.grad_mixing + mix.diagonal_index(block), sum);
  }
}

// The mixing matrix in shared memory for the prefix sweeps: row(i)[-d] is w(i, i - d), d >= 1
// (m_{i, i-d} inside the trained length, m_{M-1, M-1-d} for the sliding rows past it).
struct RowWeights {
  const float* ms;  // [M][M] in shared memory
  int M;
  __device__ __forceinline__ const float* row(int i) const {
    return i < M ? ms + i * M + i : ms + (M - 1) * M + M - 1;
  }
};

__device__ __forceinline__ void stage_mixing(const CausalWeights& mix, float* ms) {
  if (mix.m == nullptr) return;
  for (int i = threadIdx.x; i < mix.M * mix.M; i += kSweepThreads) ms[i] = mix.m[i];
}

struct BlockWork {  // one 64-token block of one (batch, head)
  int bh, b, h, block, begin, valid;
};

__device__ __forceinline__ BlockWork block_work(const CausalBlockLinearShape& s) {
  BlockWork w;
  w.bh = blockIdx.y;
  w.b = w.bh / s.heads;
  w.h = w.bh % s.heads;
  w.block = blockIdx.x;
  w.begin = w.block * kC;
  w.valid = min(kC, s.tokens - w.begin);
  return w;
}

// Floats per block of a set of states, prefixes or their gradients: D * D + D, or packed (see
// causal_prefix_packed) D * D / 2 + D.
__host__ __device__ constexpr int set_floats(int head_dim, bool packed) {
  return packed ? head_dim * head_dim / 2 + head_dim : head_dim * head_dim + head_dim;
}

__device__ __forceinline__ size_t state_offset(const BlockWork& w, int blocks, int state) {
  return (static_cast<size_t>(w.bh) * blocks + w.block) * state;
}

__device__ __forceinline__ size_t out_row(const CausalBlockLinearShape& s, const BlockWork& w,
                                          int r) {
  return (static_cast<size_t>(w.b) * s.tokens + w.begin + r) * s.heads + w.h;
}

// Bump allocator over dynamic shared memory (128-byte aligned pieces).
struct SharedCursor {
  unsigned char* at;
  template <typename X>
  __device__ X* take(size_t count) {
    X* p = reinterpret_cast<X*>(at);
    at += align128(count * sizeof(X));
    return p;
  }
};

// ---------------------------------------------------------------------------------------------
// Forward

template <typename T, int D>
__host__ __device__ constexpr size_t states_smem() {
  using L = Layout<T, D, kCausalThreads>;
  return 2 * align128(kC * L::lde * sizeof(typename Mma<T>::elem));
}

// S_j = phi(K_j)^T [V_j, 1] for one block.
template <typename T, int D>
__global__ void __launch_bounds__(kCausalThreads) states_kernel(CausalBlockLinearForward p) {
  using L = Layout<T, D, kCausalThreads>;
  using E = typename Mma<T>::elem;
  extern __shared__ __align__(128) unsigned char smem[];
  SharedCursor cursor{smem};
  E* kf = cursor.take<E>(kC * L::lde);
  E* vt = cursor.take<E>(kC * L::lde);
  const BlockWork w = block_work(p.shape);
  load_features<T, D, kCausalThreads>(p.k, w.b, w.h, w.begin, w.valid, kC, kf, nullptr);
  load_plain<T, D, kCausalThreads>(p.v, w.b, w.h, w.begin, w.valid, kC, vt);
  __syncthreads();
  FragC<T> acc[L::frags_per_warp];
#pragma unroll
  for (int u = 0; u < L::frags_per_warp; ++u) wmma::fill_fragment(acc[u], 0.f);
  accumulate_at_b<T, D, kCausalThreads>(acc, kf, vt, kC);
  float* state = p.states + state_offset(w, blocks_of(p.shape.tokens), L::state);
  write_state<T, D, kCausalThreads>(acc, state, /*atomic=*/false, nullptr);
  if (threadIdx.x < D) {
    float z = 0.f;
    for (int r = 0; r < w.valid; ++r) z += to_float(kf[r * L::lde + threadIdx.x]);
    state[D * D + threadIdx.x] = z;
  }
}

// One thread's pair of elements e, e + 1 in every block of one batch*head's part of a set: its
// address in block 0, the bytes between blocks and whether the pair is stored as bf16 (a packed
// set's matrix part; e is even and D * D too, so a pair never straddles the matrix's end). The
// windowed sweeps address their loads and stores through it: one multiply-add per access instead
// of the set's 64-bit block arithmetic and layout branches.
struct PairColumn {
  char* first;
  int block_bytes;
  bool narrow;
  __device__ __forceinline__ char* at(int block) const {
    return first + static_cast<long long>(block) * block_bytes;
  }
};

__device__ __forceinline__ PairColumn pair_column(const float* set, int matrix, int stride,
                                                  bool packed, size_t first_block, int e) {
  const bool narrow = packed && e < matrix;
  const size_t offset = narrow ? static_cast<size_t>(e) * 2
                               : static_cast<size_t>(packed ? matrix / 2 + e - matrix : e) * 4;
  char* base = reinterpret_cast<char*>(const_cast<float*>(set)) + first_block * stride * 4;
  return {base + offset, stride * 4, narrow};
}

// Where the prefix sweeps write P_i: a fp32 set (D * D + D floats per block) or a packed one
// (causal_prefix_packed: the matrix in bf16, then z in fp32). Elements are the state's (matrix
// row-major, then z).
struct PrefixSink {
  float* set;
  int matrix;  // D * D
  int stride;  // floats per block
  bool packed;
  __device__ __forceinline__ float* block(size_t index) const { return set + index * stride; }
  __device__ __forceinline__ void store(size_t index, int e, float v) const {
    float* b = block(index);
    if (!packed) {
      b[e] = v;
    } else if (e < matrix) {
      reinterpret_cast<__nv_bfloat16*>(b)[e] = __float2bfloat16(v);
    } else {
      b[matrix / 2 + e - matrix] = v;
    }
  }
  __device__ __forceinline__ PairColumn column(size_t first_block, int e) const {
    return pair_column(set, matrix, stride, packed, first_block, e);
  }
};

PrefixSink prefix_sink(float* set, int head_dim, bool packed) {
  return {set, head_dim * head_dim, set_floats(head_dim, packed), packed};
}

// The sweeps' view of a set they read (states S_j or prefix gradients dP_i), packed or not: the
// layout of PrefixSink, elements widened to fp32.
struct SetSource {
  const float* set;
  int matrix;  // D * D
  int stride;  // floats per block
  bool packed;
  __device__ __forceinline__ const float* block(size_t index) const { return set + index * stride; }
  __device__ __forceinline__ float load(size_t index, int e) const {
    const float* b = block(index);
    if (!packed) return b[e];
    if (e < matrix) return __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(b)[e]);
    return b[matrix / 2 + e - matrix];
  }
  __device__ __forceinline__ PairColumn column(size_t first_block, int e) const {
    return pair_column(set, matrix, stride, packed, first_block, e);
  }
};

// A pair column's element pair copied asynchronously into an 8-byte slot (4 bytes of bf16 or 8 of
// fp32; zeros when !valid) and read back as fp32.
__device__ __forceinline__ void copy_pair(float2* slot, const PairColumn& c, int block,
                                          bool valid) {
  if (c.narrow) {
    async_copy::copy<4>(slot, c.at(block), valid);
  } else {
    async_copy::copy<8>(slot, c.at(block), valid);
  }
}
__device__ __forceinline__ float2 unpack_pair(const float2* slot, const PairColumn& c) {
  return c.narrow ? __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(slot)) : *slot;
}
__device__ __forceinline__ void store_pair(const PairColumn& c, int block, float2 v) {
  if (c.narrow) {
    *reinterpret_cast<__nv_bfloat162*>(c.at(block)) = __floats2bfloat162_rn(v.x, v.y);
  } else {
    *reinterpret_cast<float2*>(c.at(block)) = v;
  }
}

SetSource set_source(const float* set, int head_dim, bool packed) {
  return {set, head_dim * head_dim, set_floats(head_dim, packed), packed};
}

// P_i = sum_{d=1}^{min(i, W)} w(i, i-d) S_{i-d} + [i >= M] tail * R, R = sum_{j <= i-M} S_j, for
// one state element per thread. The last W states sit in a per-thread shared-memory ring (slot
// j % W), R in a register: each state is read once and each prefix written once.
__global__ void __launch_bounds__(kSweepThreads)
    prefix_kernel(SetSource states, PrefixSink prefix, CausalWeights mix, int blocks, int state) {
  extern __shared__ __align__(128) float shared[];
  const int W = mix.window(), M = W + 1, t = threadIdx.x;
  float* ms = shared;            // [M][M]
  float* ring = shared + M * M;  // [W][kSweepThreads]
  stage_mixing(mix, ms);
  __syncthreads();
  const int e = blockIdx.x * kSweepThreads + t;
  if (e >= state) return;  // the ring is per thread: no barrier below
  const RowWeights weights{ms, M};
  const size_t first = static_cast<size_t>(blockIdx.y) * blocks;
  const float tail = mix.tail();
  float r = 0.f, s = states.load(first, e);
  for (int i = 0; i < blocks; ++i) {
    // The next state is loaded before this one is used (the sweep is latency-bound otherwise).
    const float s_next = i + 1 < blocks ? states.load(first + i + 1, e) : 0.f;
    float p = i >= M ? tail * r : 0.f;
    const int reach = min(i, W);
    const float* w = weights.row(i);
    int slot = reach > 0 ? (i - 1) % W : 0;
    for (int d = 1; d <= reach; ++d) {
      p += w[-d] * ring[slot * kSweepThreads + t];
      slot = slot == 0 ? W - 1 : slot - 1;
    }
    prefix.store(first + i, e, p);
    if (W == 0) {
      r += s;
    } else {
      const int at = (i % W) * kSweepThreads + t;
      if (i >= W) r += ring[at];  // S_{i-W} leaves the window
      ring[at] = s;
    }
    s = s_next;
  }
}

// The same sweep with the window W a compile-time constant (the common matrix sizes), two
// adjacent state elements per thread (every state size D * D + D is even):
// - The last M = W + 1 states sit in registers as a ring indexed by block mod M, and the block
//   loop runs in groups of M unrolled steps, so every ring index is a constant: no moves to
//   shift a window. The sweeps are bound by their instructions, not by DRAM (session 22: DRAM
//   at 15-34 % of its peak, the same time at 4, 8 or 16 loads in flight), and the shifts were
//   a third of them.
// - Past the trained rows (i >= M) every block takes the sliding row's weights, from shared
//   memory (one broadcast per product: in registers they cost the occupancy that four CTAs per
//   SM need; with one element per thread the sweep's 65 x B*H CTAs took four waves at
//   B*H = 32, 33 x B*H take two).
// - The loads run Ahead blocks ahead through a per-thread ring of Ahead + 1 slots in shared
//   memory (cp.async; each thread reads back only its own copies), so blocks in flight cost no
//   registers. Block i + Ahead goes into block i - 1's slot, whose value the products of step i
//   consume before the step's store.
template <int W, int Ahead>
__global__ void __launch_bounds__(kSweepThreads, W <= 15 ? 4 : 2)
    prefix_window_kernel(SetSource states, PrefixSink prefix, CausalWeights mix, int blocks,
                         int state) {
  constexpr int M = W + 1, Slots = Ahead + 1;
  __shared__ float ms[M * M];
  __shared__ __align__(16) float sliding_row[M];  // sliding_row[d] = w(i, i - d), i >= M
  __shared__ float2 ring[Slots][kSweepThreads];
  // Linear attention is the window W = 0 with weight 1: P_i = sum_{b < i} S_b.
  for (int i = threadIdx.x; i < M * M; i += kSweepThreads)
    ms[i] = mix.m != nullptr ? mix.m[i] : 1.f;
  __syncthreads();
  for (int d = threadIdx.x; d < M; d += kSweepThreads) sliding_row[d] = ms[(M - 1) * M + M - 1 - d];
  __syncthreads();
  const int t = threadIdx.x, e = 2 * (blockIdx.x * kSweepThreads + t);
  if (e >= state) return;  // no barrier below
  const float tail = ms[(M - 1) * M];
  const size_t first = static_cast<size_t>(blockIdx.y) * blocks;
  // Loads and stores through pair columns (one multiply-add per address; see the backward sweep).
  const PairColumn s_column = states.column(first, e), p_column = prefix.column(first, e);
  float2 recent[M];  // recent[b % M] = S_b for the last M blocks b (zero before the first)
#pragma unroll
  for (int k = 0; k < M; ++k) recent[k] = make_float2(0.f, 0.f);
  // Block i's slot: i % Slots, a constant where the unrolled index k (i = group + k) gives it.
  constexpr bool constant_slots = M % Slots == 0;
  auto slot_of = [&](int i, int k) { return constant_slots ? k % Slots : i % Slots; };
  // Block i into its slot, one group per block (empty past the end).
  auto fetch = [&](int i, int slot) {
    if (i < blocks) copy_pair(&ring[slot][t], s_column, i, true);
    async_copy::commit();
  };
  // Waits for block i's copy, which joins the ring after the step's products.
  auto arrive = [&](int slot) {
    async_copy::wait<Ahead - 1>();
    return unpack_pair(&ring[slot][t], s_column);
  };
#pragma unroll
  for (int a = 0; a < Ahead; ++a) fetch(a, a % Slots);
    // The trained rows i < M: P_i = sum_{d=1}^{i} m_{i, i-d} S_{i-d}.
#pragma unroll
  for (int i = 0; i < M; ++i) {
    if (i < blocks) {
      const float2 s = arrive(i % Slots);
      float2 p = make_float2(0.f, 0.f);
#pragma unroll
      for (int d = 1; d <= i; ++d) {
        const float w = ms[i * M + i - d];
        p.x += w * recent[i - d].x;
        p.y += w * recent[i - d].y;
      }
      store_pair(p_column, i, p);
      fetch(i + Ahead, (i + Ahead) % Slots);
      recent[i] = s;
    }
  }
  // The sliding rows: P_i = tail * R + sum_{d=1}^{W} w_d S_{i-d}, R = sum_{b <= i-M} S_b. At step
  // i, recent[i % M] still holds S_{i-M}: it joins R, then S_i takes its place.
  float2 r = make_float2(0.f, 0.f);
  for (int group = M; group < blocks; group += M) {
#pragma unroll
    for (int k = 0; k < M; ++k) {
      const int i = group + k;
      if (i < blocks) {
        const float2 s = arrive(slot_of(i, k));
        r.x += recent[k].x;
        r.y += recent[k].y;
        float2 p = make_float2(tail * r.x, tail * r.y);
#pragma unroll
        for (int d = 1; d <= W; ++d) {
          const float w = sliding_row[d];
          p.x += w * recent[(k - d + M) % M].x;
          p.y += w * recent[(k - d + M) % M].y;
        }
        store_pair(p_column, i, p);
        fetch(i + Ahead, slot_of(i + Ahead, k + Ahead));
        recent[k] = s;
      }
    }
  }
}

template <typename T, int D>
__host__ __device__ constexpr size_t output_smem() {
  using L = Layout<T, D, kCausalThreads>;
  using E = typename Mma<T>::elem;
  return align128(D * L::lde * sizeof(E)) + 3 * align128(kC * L::lde * sizeof(E)) +
         align128(kC * L::ldf * 4) + align128(kC * kLdScore * 4) +
         align128(kC * kLdScoreE * sizeof(E)) + align128(D * 4) + align128(kC * 4);
}

// Row sums of a masked fp32 score tile plus phi(q) . z and the epsilon: the denominators of a
// block (one warp per row).
template <typename T, int D>
__device__ void denominators(const float* scores, const typename Mma<T>::elem* qf, const float* z,
                             float diagonal_weight, float* den) {
  using L = Layout<T, D, kCausalThreads>;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int r = warp; r < kC; r += kCausalWarps) {
    float sum = 0.f;
    for (int s = lane; s <= r; s += 32) sum += scores[r * kLdScore + s];
    sum *= diagonal_weight;
    for (int d = lane; d < D; d += 32) sum += to_float(qf[r * L::lde + d]) * z[d];
    sum = warp_sum(sum);
    if (lane == 0) den[r] = sum + kDenominatorEps;
  }
}

template <typename T, int D>
__global__ void __launch_bounds__(kCausalThreads) output_kernel(CausalBlockLinearForward p) {
  using L = Layout<T, D, kCausalThreads>;
  using E = typename Mma<T>::elem;
  extern __shared__ __align__(128) unsigned char smem[];
  SharedCursor cursor{smem};
  E* prefix = cursor.take<E>(D * L::lde);
  E* qf = cursor.take<E>(kC * L::lde);
  E* kf = cursor.take<E>(kC * L::lde);
  E* vt = cursor.take<E>(kC * L::lde);
  float* numerator = cursor.take<float>(kC * L::ldf);
  float* scores = cursor.take<float>(kC * kLdScore);
  E* masked = cursor.take<E>(kC * kLdScoreE);
  float* z = cursor.take<float>(D);
  float* den = cursor.take<float>(kC);
  const BlockWork w = block_work(p.shape);
  const int blocks = blocks_of(p.shape.tokens);
  const CausalWeights mix{p.mixing, p.shape.mixing_blocks};
  const float diagonal_weight = mix.at(w.block, w.block);
  // Every load of the block (q, k, v rows and the prefix state) is in flight before the first
  // is used: one global-memory latency per CTA.
  TileRows<T, D, kCausalThreads> q_rows, k_rows, v_rows;
  q_rows.load(p.q, w.b, w.h, w.begin, w.valid, kC);
  k_rows.load(p.k, w.b, w.h, w.begin, w.valid, kC);
  v_rows.load(p.v, w.b, w.h, w.begin, w.valid, kC);
  load_state<T, D, kCausalThreads>(p.prefix + state_offset(w, blocks, L::state), prefix, z);
  q_rows.store_features(w.valid, kC, qf, nullptr);
  k_rows.store_features(w.valid, kC, kf, nullptr);
  v_rows.store_plain(kC, vt);
  __syncthreads();
  gemm<T, false, false>(qf, L::lde, prefix, L::lde, numerator, L::ldf, kC, D, D, false);
  gemm<T, false, true>(qf, L::lde, kf, L::lde, scores, kLdScore, kC, kC, D, false);
  __syncthreads();
  for (int i = threadIdx.x; i < kC * kC; i += kCausalThreads) {
    const int r = i / kC, s = i % kC;
    masked[r * kLdScoreE + s] =
        from_float<E>(s <= r ? diagonal_weight * scores[r * kLdScore + s] : 0.f);
  }
  denominators<T, D>(scores, qf, z, diagonal_weight, den);
  __syncthreads();
  gemm<T, false, false>(masked, kLdScoreE, vt, L::lde, numerator, L::ldf, kC, D, kC, true);
  __syncthreads();
  T* out = static_cast<T*>(p.out);
  const int lane = threadIdx.x % L::lanes;
  for (int r = threadIdx.x / L::lanes; r < w.valid; r += L::rows_per_pass) {
    float x[L::vec];
    const float inv = 1.f / den[r];
#pragma unroll
    for (int i = 0; i < L::vec; ++i) x[i] = numerator[r * L::ldf + lane * L::vec + i] * inv;
    store_vector<T, D>(out + out_row(p.shape, w, r) * D + lane * L::vec, x);
  }
}

// ---------------------------------------------------------------------------------------------
// Lean token passes (16-bit types): 256 threads and under half an SM's shared memory, so two
// CTAs share an SM and one's loads overlap the other's products. The passes above hold one
// 64-token block per SM with their phases in series (loads, products, stores), which left DRAM
// idle for half of each block's time (session 17: ~9 us per block for the output pass against
// ~4 us for its bytes). Products accumulate in registers (wmma_tiles::TileAccumulator), so the
// fp32 score and numerator tiles no longer take shared memory.
constexpr int kLeanThreads = 256;
constexpr int kLeanWarps = kLeanThreads / 32;

// The warp's block of 16 x 16 tiles of a 64 x D product with one block per warp: 2 x 2 tiles at
// D = 128, 1 x 2 at 64, 1 x 1 at 32.
template <int D>
struct LeanTokenTiles {
  static constexpr int cols = D >= 64 ? 2 : 1;
  static constexpr int rows = D / 32 / cols;
  static constexpr int blocks_n = (D / 16) / cols;
  static_assert((kC / 16 / rows) * blocks_n == kLeanWarps, "one tile block per warp");
  __device__ static int first_row_tile() { return (threadIdx.x / 32) / blocks_n * rows; }
  __device__ static int first_col_tile() { return (threadIdx.x / 32) % blocks_n * cols; }
};

// Two fp32 values to two adjacent 16-bit elements.
template <typename E>
__device__ __forceinline__ void store_pair(E* p, float a, float b) {
  const float v[2] = {a, b};
  store_pack<E, 2>(p, v);
}

// A warp's two 16 x 16 tiles of a block's 64 x 64 causal score matrix (and of g, whose mask is
// the same): row tile w / 2, column tiles 2 (w % 2) and the next, in registers. Tiles wholly
// above the diagonal are never multiplied and stay zero.
struct ScoreTiles {
  using Acc = wmma_tiles::TileAccumulator;
  Acc t[1][2];
  int row = static_cast<int>(threadIdx.x / 32) / 2;
  int col = (static_cast<int>(threadIdx.x / 32) % 2) * 2;

  __device__ ScoreTiles() {
    t[0][0].zero();
    t[0][1].zero();
  }
  // t = A B^T over depth k for A, B [64][k] 16-bit tiles (row strides lda, ldb).
  template <typename E>
  __device__ void multiply(const E* a, int lda, const E* b, int ldb, int k) {
    if (col <= row) wmma_tiles::mma_block<E, false, true, 1, 2>(t, a, lda, b, ldb, row, col, k);
  }
  __device__ int token_row(int i) const { return row * 16 + Acc::row(i); }
  __device__ int token_col(int j, int h, int i) const { return (col + j) * 16 + Acc::col(h, i); }
  __device__ bool on_mask(int j, int h, int i) const { return token_col(j, h, i) <= token_row(i); }
  // Zeroes the entries above the diagonal and writes the row sums of the two tiles to
  // row_part[(w % 2) * kC + r] (lanes 4r'..4r'+3 share a row).
  __device__ void mask_and_sum_rows(float* row_part) {
    float sums[2] = {0.f, 0.f};
#pragma unroll
    for (int j = 0; j < 2; ++j) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float v = on_mask(j, h, i) ? t[0][j].x[h][i] : 0.f;
          t[0][j].x[h][i] = v;
          sums[i / 2] += v;
        }
      }
    }
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      sums[u] += __shfl_xor_sync(0xffffffffu, sums[u], 1);
      sums[u] += __shfl_xor_sync(0xffffffffu, sums[u], 2);
    }
    const int lane = static_cast<int>(threadIdx.x % 32);
    if (lane % 4 == 0) {
      float* part = row_part + (static_cast<int>(threadIdx.x / 32) % 2) * kC + row * 16 + lane / 4;
      part[0] = sums[0];
      part[8] = sums[1];
    }
  }
  // scale * t into a 16-bit [64][kLdScoreE] tile.
  template <typename E>
  __device__ void store_scaled(E* dst, float scale) const {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int i = 0; i < 4; i += 2) {
          store_pair(dst + token_row(i) * kLdScoreE + token_col(j, h, i), scale * t[0][j].x[h][i],
                     scale * t[0][j].x[h][i + 1]);
        }
      }
    }
  }
};

// phi(q_r) . z for the block's 64 rows (one warp per row) into out.
template <typename E, int D, int Ld>
__device__ void rows_dot_z(const E* qf, const float* z, float* out) {
  const int warp = static_cast<int>(threadIdx.x / 32), lane = static_cast<int>(threadIdx.x % 32);
  for (int r = warp; r < kC; r += kLeanWarps) {
    float dot = 0.f;
    for (int d = lane; d < D; d += 32) dot += to_float(qf[r * Ld + d]) * z[d];
    dot = warp_sum(dot);
    if (lane == 0) out[r] = dot;
  }
}

// P_i of a packed set (causal_prefix_packed) into shared memory by cp.async: the matrix's rows
// into the tile (row stride L::lde), z into its fp32 array. wait_copies() completes them.
template <typename T, int D>
__device__ __forceinline__ void copy_packed_prefix(const float* set, size_t block,
                                                   typename Mma<T>::elem* s, float* z) {
  using L = Layout<T, D, kLeanThreads>;
  const char* src = reinterpret_cast<const char*>(set + block * (D * D / 2 + D));
  constexpr int kRowCopies = D / 8, kMatrixCopies = D * kRowCopies, kCopies = kMatrixCopies + D / 4;
  for (int c = threadIdx.x; c < kCopies; c += kLeanThreads) {
    void* dst = c < kMatrixCopies
                    ? static_cast<void*>(s + (c / kRowCopies) * L::lde + (c % kRowCopies) * 8)
                    : static_cast<void*>(z + (c - kMatrixCopies) * 4);
    const unsigned at = static_cast<unsigned>(__cvta_generic_to_shared(dst));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(at), "l"(src + c * 16));
  }
  asm volatile("cp.async.commit_group;\n" ::);
}

__device__ __forceinline__ void wait_copies() {
  asm volatile("cp.async.wait_all;\n" ::: "memory");
}

// P_i and z_i of the block into shared memory, from a packed set (bf16 only: the host refuses
// others) or a fp32 one. A packed copy is asynchronous: wait_copies() before the barrier.
template <typename T, int D>
__device__ __forceinline__ void start_prefix_load(const float* set, bool packed, size_t block,
                                                  typename Mma<T>::elem* s, float* z) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    if (packed) {
      copy_packed_prefix<T, D>(set, block, s, z);
      return;
    }
  }
  load_state<T, D, kLeanThreads, 8>(set + block * (D * D + D), s, z);
}

template <typename T, int D>
__host__ __device__ constexpr size_t lean_output_smem() {
  using L = Layout<T, D, kLeanThreads>;
  using E = typename Mma<T>::elem;
  constexpr int key_ld = L::lde > kLdScoreE ? L::lde : kLdScoreE;  // kf, then the masked scores
  return align128(D * L::lde * sizeof(E)) + 2 * align128(kC * L::lde * sizeof(E)) +
         align128(kC * key_ld * sizeof(E)) + align128(D * 4) + 3 * align128(kC * 4);
}

// The output pass of output_kernel for 16-bit T. Warp w takes the score tiles (w / 2, 2 (w % 2))
// and (w / 2, 2 (w % 2) + 1) and one LeanTokenTiles block of the numerator.
template <typename T, int D>
__global__ void __launch_bounds__(kLeanThreads, 2) lean_output_kernel(CausalBlockLinearForward p) {
  using L = Layout<T, D, kLeanThreads>;
  using E = typename Mma<T>::elem;
  using Tiles = LeanTokenTiles<D>;
  using wmma_tiles::TileAccumulator;
  extern __shared__ __align__(128) unsigned char smem[];
  SharedCursor cursor{smem};
  constexpr int key_ld = L::lde > kLdScoreE ? L::lde : kLdScoreE;
  E* prefix = cursor.take<E>(D * L::lde);
  E* qf = cursor.take<E>(kC * L::lde);  // phi(Q), then the output rows
  E* vt = cursor.take<E>(kC * L::lde);
  E* kf = cursor.take<E>(kC * key_ld);  // phi(K), then the masked scores
  E* masked = kf;
  float* z = cursor.take<float>(D);
  float* row_part = cursor.take<float>(2 * kC);  // score row sums of the two column halves
  float* den = cursor.take<float>(kC);
  const BlockWork w = block_work(p.shape);
  const int blocks = blocks_of(p.shape.tokens);
  const CausalWeights mix{p.mixing, p.shape.mixing_blocks};
  const float diagonal_weight = mix.at(w.block, w.block);
  const size_t prefix_block = static_cast<size_t>(w.bh) * blocks + w.block;
  if (p.packed_prefix) start_prefix_load<T, D>(p.prefix, true, prefix_block, prefix, z);
  {
    TileRows<T, D, kLeanThreads> q_rows, k_rows, v_rows;
    q_rows.load(p.q, w.b, w.h, w.begin, w.valid, kC);
    k_rows.load(p.k, w.b, w.h, w.begin, w.valid, kC);
    v_rows.load(p.v, w.b, w.h, w.begin, w.valid, kC);
    if (!p.packed_prefix) start_prefix_load<T, D>(p.prefix, false, prefix_block, prefix, z);
    q_rows.store_features(w.valid, kC, qf, nullptr);
    k_rows.store_features(w.valid, kC, kf, nullptr);
    v_rows.store_plain(kC, vt);
  }
  wait_copies();
  __syncthreads();
  // Scores phi(Q) phi(K)^T on the causal mask.
  ScoreTiles scores;
  scores.multiply(qf, L::lde, kf, L::lde, D);
  // Numerator, first part: phi(Q) P.
  const int fm = Tiles::first_row_tile(), fn = Tiles::first_col_tile();
  TileAccumulator numerator[Tiles::rows][Tiles::cols];
#pragma unroll
  for (int i = 0; i < Tiles::rows; ++i) {
#pragma unroll
    for (int j = 0; j < Tiles::cols; ++j) numerator[i][j].zero();
  }
  wmma_tiles::mma_block<E, false, false, Tiles::rows, Tiles::cols>(numerator, qf, L::lde, prefix,
                                                                   L::lde, fm, fn, D);
  scores.mask_and_sum_rows(row_part);
  rows_dot_z<E, D, L::lde>(qf, z, den);
  __syncthreads();  // every warp is done with phi(K), phi(Q) and P
  scores.store_scaled(masked, diagonal_weight);
  if (threadIdx.x < kC) {
    const int r = threadIdx.x;
    den[r] += diagonal_weight * (row_part[r] + row_part[kC + r]) + kDenominatorEps;
  }
  __syncthreads();
  // Numerator, second part: w_ii tril(phi(Q) phi(K)^T) V; masked columns past the warp's last
  // row are zero.
  wmma_tiles::mma_block<E, false, false, Tiles::rows, Tiles::cols>(
      numerator, masked, kLdScoreE, vt, L::lde, fm, fn, (fm + Tiles::rows) * 16);
  // Normalized rows into phi(Q)'s tile (free since the barrier), then 16-byte stores.
  E* stage = qf;
#pragma unroll
  for (int i = 0; i < Tiles::rows; ++i) {
#pragma unroll
    for (int j = 0; j < Tiles::cols; ++j) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int e = 0; e < 4; e += 2) {
          const int r = (fm + i) * 16 + TileAccumulator::row(e);
          const int c = (fn + j) * 16 + TileAccumulator::col(h, e);
          const float inv = 1.f / den[r];
          store_pair(stage + r * L::lde + c, numerator[i][j].x[h][e] * inv,
                     numerator[i][j].x[h][e + 1] * inv);
        }
      }
    }
  }
  __syncthreads();
  T* out = static_cast<T*>(p.out);
  const int row_lane = threadIdx.x % L::lanes;
  for (int r = threadIdx.x / L::lanes; r < w.valid; r += L::rows_per_pass) {
    *reinterpret_cast<uint4*>(out + out_row(p.shape, w, r) * D + row_lane * L::vec) =
        *reinterpret_cast<const uint4*>(stage + r * L::lde + row_lane * L::vec);
  }
}

template <typename T, int D>
__host__ __device__ constexpr size_t lean_states_smem() {
  using L = Layout<T, D, kLeanThreads>;
  return 2 * align128(kC * L::lde * sizeof(typename Mma<T>::elem));
}

// states_kernel for 16-bit T: three CTAs per SM, S_j = phi(K_j)^T V_j written from the warps'
// accumulators (ldmatrix + mma.sync instead of WMMA's generic fragment loads).
template <typename T, int D>
__global__ void __launch_bounds__(kLeanThreads, 3) lean_states_kernel(CausalBlockLinearForward p) {
  using L = Layout<T, D, kLeanThreads>;
  using E = typename Mma<T>::elem;
  extern __shared__ __align__(128) unsigned char smem[];
  SharedCursor cursor{smem};
  E* kf = cursor.take<E>(kC * L::lde);
  E* vt = cursor.take<E>(kC * L::lde);
  const BlockWork w = block_work(p.shape);
  {
    TileRows<T, D, kLeanThreads> k_rows, v_rows;
    k_rows.load(p.k, w.b, w.h, w.begin, w.valid, kC);
    v_rows.load(p.v, w.b, w.h, w.begin, w.valid, kC);
    k_rows.store_features(w.valid, kC, kf, nullptr);
    v_rows.store_plain(kC, vt);
  }
  __syncthreads();
  float* state =
      p.states + state_offset(w, blocks_of(p.shape.tokens), set_floats(D, p.packed_states));
  // Packed: S in bf16, z in fp32 (every reader takes S as bf16 tiles or sums it in fp32).
  if (p.packed_states) {
    wmma_tiles::gemm_blocked<E, kLeanWarps, true, false>(
        kf, L::lde, vt, L::lde, reinterpret_cast<__nv_bfloat16*>(state), D, D, D, kC);
  } else {
    wmma_tiles::gemm_blocked<E, kLeanWarps, true, false>(kf, L::lde, vt, L::lde, state, D, D, D, kC,
                                                         false);
  }
  float* z_out = state + (p.packed_states ? D * D / 2 : D * D);
  if (threadIdx.x < D) {
    float z = 0.f;
    for (int r = 0; r < w.valid; ++r) z += to_float(kf[r * L::lde + threadIdx.x]);
    z_out[threadIdx.x] = z;
  }
}

// ---------------------------------------------------------------------------------------------
// Backward

template <typename T, int D>
__host__ __device__ constexpr size_t query_backward_smem() {
  using L = Layout<T, D, kCausalThreads>;
  using E = typename Mma<T>::elem;
  return align128(D * L::lde * sizeof(E)) + 4 * align128(kC * L::lde * sizeof(E)) +
         align128(kC * L::ldf * 4) + 2 * align128(kC * kLdScore * 4) +
         2 * align128(kC * kLdScoreE * sizeof(E)) + align128(D * 4) + 3 * align128(kC * 4) +
         align128(kCausalWarps * 4);
}

// For one block i: dq; dP_i = phi(Q)^T [dO / den, dden]; the intra-block parts of d(phi(k)) and
// dv, written into grad_k and grad_v for the key pass to complete; and dm_ii.
template <typename T, int D>
__global__ void __launch_bounds__(kCausalThreads)
    query_backward_kernel(CausalBlockLinearBackward p) {
  using L = Layout<T, D, kCausalThreads>;
  using E = typename Mma<T>::elem;
  extern __shared__ __align__(128) unsigned char smem[];
  SharedCursor cursor{smem};
  E* prefix = cursor.take<E>(D * L::lde);
  E* qf = cursor.take<E>(kC * L::lde);
  E* kf = cursor.take<E>(kC * L::lde);
  E* vt = cursor.take<E>(kC * L::lde);
  E* dnum = cursor.take<E>(kC * L::lde);
  float* dphi = cursor.take<float>(kC * L::ldf);
  float* scores = cursor.take<float>(kC * kLdScore);
  float* g = cursor.take<float>(kC * kLdScore);
  E* g_masked = cursor.take<E>(kC * kLdScoreE);
  E* scores_masked = cursor.take<E>(kC * kLdScoreE);
  float* z = cursor.take<float>(D);
  float* inv_rms = cursor.take<float>(kC);
  float* den = cursor.take<float>(kC);
  float* dden = cursor.take<float>(kC);
  float* warp_partial = cursor.take<float>(kCausalWarps);
  const BlockWork w = block_work(p.shape);
  const int blocks = blocks_of(p.shape.tokens);
  const CausalWeights mix{p.mixing, p.shape.mixing_blocks};
  const float diagonal_weight = mix.at(w.block, w.block);
  const size_t offset = state_offset(w, blocks, L::state);
  // q, k, v rows and the prefix in flight together; q's raw rows stay in registers for the
  // feature backward at the end.
  TileRows<T, D, kCausalThreads> q_rows;
  {
    TileRows<T, D, kCausalThreads> k_rows, v_rows;
    q_rows.load(p.q, w.b, w.h, w.begin, w.valid, kC);
    k_rows.load(p.k, w.b, w.h, w.begin, w.valid, kC);
    v_rows.load(p.v, w.b, w.h, w.begin, w.valid, kC);
    load_state<T, D, kCausalThreads>(p.prefix + offset, prefix, z);
    q_rows.store_features(w.valid, kC, qf, inv_rms);
    k_rows.store_features(w.valid, kC, kf, nullptr);
    v_rows.store_plain(kC, vt);
  }
  // dO and o rows: issued here, used after the scores product and the denominators.
  TileRows<T, D, kCausalThreads> go_rows, o_rows;
  go_rows.load(p.grad_out, w.b, w.h, w.begin, w.valid, kC);
  o_rows.load(p.out, w.b, w.h, w.begin, w.valid, kC);
  __syncthreads();
  gemm<T, false, true>(qf, L::lde, kf, L::lde, scores, kLdScore, kC, kC, D, false);
  __syncthreads();
  denominators<T, D>(scores, qf, z, diagonal_weight, den);
  __syncthreads();
  // d(numerator) = dO / den; d(den) = -(dO . o) / den.
  const int lane = threadIdx.x % L::lanes;
#pragma unroll
  for (int pass = 0; pass < TileRows<T, D, kCausalThreads>::passes; ++pass) {
    const int r = TileRows<T, D, kCausalThreads>::row(pass);
    if (r >= kC) break;
    float go[L::vec], o[L::vec];
    float dot = 0.f;
    if (r < w.valid) {
      go_rows.values(pass, go);
      o_rows.values(pass, o);
      const float inv = 1.f / den[r];
#pragma unroll
      for (int i = 0; i < L::vec; ++i) {
        dot += go[i] * o[i];
        go[i] *= inv;
      }
    } else {
#pragma unroll
      for (int i = 0; i < L::vec; ++i) go[i] = 0.f;
    }
    dot = row_sum<L::lanes>(dot);
#pragma unroll
    for (int i = 0; i < L::vec; ++i) dnum[r * L::lde + lane * L::vec + i] = from_float<E>(go[i]);
    if (lane == 0) dden[r] = r < w.valid ? -dot / den[r] : 0.f;
  }
  __syncthreads();
  gemm<T, false, true>(dnum, L::lde, vt, L::lde, g, kLdScore, kC, kC, D, false);  // dnum V^T
  __syncthreads();
  // g' = dnum . v_s + dden_t on the causal mask; dm_ii = sum g' * (phi(q_t) . phi(k_s)).
  float diagonal_grad = 0.f;
  for (int i = threadIdx.x; i < kC * kC; i += kCausalThreads) {
    const int r = i / kC, s = i % kC;
    const bool on = s <= r;
    const float gr = on ? g[r * kLdScore + s] + dden[r] : 0.f;
    const float sc = on ? scores[r * kLdScore + s] : 0.f;
    diagonal_grad += gr * sc;
    g_masked[r * kLdScoreE + s] = from_float<E>(diagonal_weight * gr);
    scores_masked[r * kLdScoreE + s] = from_float<E>(diagonal_weight * sc);
  }
  diagonal_grad = warp_sum(diagonal_grad);
  if (threadIdx.x % 32 == 0) warp_partial[threadIdx.x / 32] = diagonal_grad;
  __syncthreads();
  if (threadIdx.x == 0 && p.mixing != nullptr) {
    float sum = 0.f;
    for (int i = 0; i < kCausalWarps; ++i) sum += warp_partial[i];
    add_diagonal_grad(p, mix, w.block, sum);
  }
  // d(phi(q)) = dnum P^T + dden z^T (below) + g'_masked phi(K).
  gemm<T, false, true>(dnum, L::lde, prefix, L::lde, dphi, L::ldf, kC, D, D, false);
  __syncthreads();  // the next product adds to tiles another lane of the warp stored
  gemm<T, false, false>(g_masked, kLdScoreE, kf, L::lde, dphi, L::ldf, kC, D, kC, true);
  {  // dP_i = phi(Q)^T dnum, dz_i = phi(Q)^T dden: stored, one CTA per block.
    FragC<T> acc[L::frags_per_warp];
#pragma unroll
    for (int u = 0; u < L::frags_per_warp; ++u) wmma::fill_fragment(acc[u], 0.f);
    accumulate_at_b<T, D, kCausalThreads>(acc, qf, dnum, kC);
    write_state<T, D, kCausalThreads>(acc, p.grad_prefix + offset, /*atomic=*/false, nullptr);
    if (threadIdx.x < D) {
      float dz = 0.f;
      for (int r = 0; r < w.valid; ++r) dz += to_float(qf[r * L::lde + threadIdx.x]) * dden[r];
      p.grad_prefix[offset + D * D + threadIdx.x] = dz;
    }
  }
  __syncthreads();
  T* grad_q = static_cast<T*>(p.grad_q);
  // Whole warps run the row loop (feature_backward shuffles across a row's lanes).
#pragma unroll
  for (int pass = 0; pass < TileRows<T, D, kCausalThreads>::passes; ++pass) {
    const int r = TileRows<T, D, kCausalThreads>::row(pass);
    if (r >= kC) break;
    float x[L::vec], gq[L::vec];
    const bool live = r < w.valid;
    q_rows.values(pass, x);
#pragma unroll
    for (int i = 0; i < L::vec; ++i) {
      const int d = lane * L::vec + i;
      if (!live) x[i] = 0.f;
      gq[i] = live ? dphi[r * L::ldf + d] + dden[r] * z[d] : 0.f;
    }
    feature_backward<T, D, kCausalThreads>(x, live ? inv_rms[r] : 0.f, gq);
    if (live) store_vector<T, D>(grad_q + out_row(p.shape, w, r) * D + lane * L::vec, gq);
  }
  __syncthreads();
  // Intra-block parts for the key pass: d(phi(k)) = g'_masked^T phi(Q), dv = masked^T dnum.
  T* grad_k = static_cast<T*>(p.grad_k);
  T* grad_v = static_cast<T*>(p.grad_v);
  for (int pass = 0; pass < 2; ++pass) {
    gemm<T, true, false>(pass == 0 ? g_masked : scores_masked, kLdScoreE, pass == 0 ? qf : dnum,
                         L::lde, dphi, L::ldf, kC, D, kC, false);
    __syncthreads();
    T* dst = pass == 0 ? grad_k : grad_v;
    for (int r = threadIdx.x / L::lanes; r < w.valid; r += L::rows_per_pass) {
      store_vector<T, D>(dst + out_row(p.shape, w, r) * D + lane * L::vec,
                         dphi + r * L::ldf + lane * L::vec);
    }
    __syncthreads();
  }
}

// dS_j = sum_{i > j} w(i, j) dP_i, one state element per thread, for (batch*head, column) items
// walked by persistent CTAs; and, past the trained length (blocks > M), the gradient of the
// sliding row m_{M-1,:} by window offset in a per-thread shared-memory column, added to
// grad_mixing once per CTA. The rows inside the trained length are the caller's (a GEMM over the
// states: dm_ij += sum <dP_i, S_j> for j < i < M). Loads of the next block are issued before the
// current one is used: the sweeps are latency-bound otherwise.
__global__ void __launch_bounds__(kSweepThreads)
    prefix_backward_kernel(SetSource states, SetSource grad_prefix, PrefixSink grad_states,
                           float* grad_mixing, CausalWeights mix, int batch_heads, int blocks,
                           int state) {
  extern __shared__ __align__(128) float shared[];
  const int W = mix.window(), M = W + 1, t = threadIdx.x, lane = t % 32;
  float* ms = shared;                                 // [M][M]: the mixing matrix
  float* ring = ms + M * M;                           // [max(W, 1)][kSweepThreads]
  float* sliding = ring + max(W, 1) * kSweepThreads;  // [M][kSweepThreads]
  float* dm_row = sliding + M * kSweepThreads;        // [M]: this CTA's sum for row M - 1
  stage_mixing(mix, ms);
  const RowWeights weights{ms, M};
  const bool slides = mix.m != nullptr && blocks > M;
  for (int k = t; k < M; k += kSweepThreads) dm_row[k] = 0.f;
  for (int k = 0; k < M; ++k) sliding[k * kSweepThreads + t] = 0.f;
  __syncthreads();
  const float tail = mix.tail();
  const int columns = (state + kSweepThreads - 1) / kSweepThreads;
  for (int item = blockIdx.x; item < batch_heads * columns; item += gridDim.x) {
    const int e = (item % columns) * kSweepThreads + t;
    const bool live = e < state;
    const size_t first = static_cast<size_t>(item / columns) * blocks;
    auto load = [&](const SetSource& set, int i) {
      return live && i >= 0 && i < blocks ? set.load(first + i, e) : 0.f;
    };
    if (slides) {  // dm of the sliding rows: the forward sweep again, dP_i in place of the output.
      float r = 0.f, x = load(grad_prefix, 0), s = load(states, 0);
      for (int i = 0; i < blocks; ++i) {
        const float x_next = load(grad_prefix, i + 1), s_next = load(states, i + 1);
        if (i >= M) {
          int slot = W > 0 ? (i - 1) % W : 0;
          for (int d = 1; d <= W; ++d) {
            sliding[(M - 1 - d) * kSweepThreads + t] += x * ring[slot * kSweepThreads + t];
            slot = slot == 0 ? W - 1 : slot - 1;
          }
          sliding[t] += x * r;
        }
        if (W == 0) {
          r += s;
        } else {
          const int at = (i % W) * kSweepThreads + t;
          if (i >= W) r += ring[at];
          ring[at] = s;
        }
        x = x_next, s = s_next;
      }
    }
    // dS_j = sum_{d=1}^{W} w(j+d, j) dP_{j+d} + tail * U, U = sum_{i >= j+M} dP_i: a reverse sweep
    // with the next W prefix gradients in the ring.
    float u = 0.f, x = load(grad_prefix, blocks - 1);
    for (int j = blocks - 1; j >= 0; --j) {
      const float x_next = load(grad_prefix, j - 1);
      const int reach = min(blocks - 1 - j, W);
      float g = tail * u;
      int slot = reach > 0 ? (j + 1) % W : 0;
      for (int d = 1; d <= reach; ++d) {
        g += weights.row(j + d)[-d] * ring[slot * kSweepThreads + t];
        slot = slot == W - 1 ? 0 : slot + 1;
      }
      if (live) grad_states.store(first + j, e, g);
      if (W == 0) {
        u += x;
      } else {
        const int at = (j % W) * kSweepThreads + t;
        if (j + W <= blocks - 1) u += ring[at];  // dP_{j+W} leaves the window
        ring[at] = x;
      }
      x = x_next;
    }
  }
  if (!slides) return;
  for (int k = 0; k < M; ++k) {
    const float v = warp_sum(sliding[k * kSweepThreads + t]);
    if (lane == 0) atomicAdd(dm_row + k, v);
  }
  __syncthreads();
  for (int k = t; k < M; k += kSweepThreads) atomicAdd(grad_mixing + (M - 1) * M + k, dm_row[k]);
}

// The backward sweep's unrolled group of blocks (a multiple of M, at least 8) and its load rings'
// slots (a divisor of the group, so that every slot index is a constant), loads running
// Slots - 1 blocks ahead.
constexpr int backward_sweep_group(int m) {
  return m >= 8 ? m : m * ((8 + m - 1) / m);
}
constexpr int backward_sweep_slots(int m) {
  return backward_sweep_group(m) % 8 == 0 ? 8 : backward_sweep_group(m);
}

// prefix_backward_kernel with the window W a compile-time constant, as prefix_window_kernel: two
// adjacent state elements per thread (one CTA per 512 elements of one batch*head: with one
// element per thread, persistent CTAs and narrow accesses, linear attention's running sum alone
// took 247 us at T = 8,192, B*H = 32), the last M prefix gradients in a register ring indexed by
// block mod M, the blocks in unrolled groups (constant ring indices), the sliding row's weights
// and its gradient sums in registers, and the loads Ahead blocks ahead through per-thread rings
// in shared memory (block j - Ahead goes into block j + 1's slot, whose dP the products of step j
// and whose S those of step j + 1 have consumed).
// This sweep is bound by its instruction issue (Nsight Compute at T = 2,048: issue slots 71 %
// busy, 198 instructions per warp and block, session 23), so its accesses go through pair
// columns (one multiply-add per address) and the group makes every slot index a constant.
template <int W>
__global__ void __launch_bounds__(kSweepThreads, W <= 15 ? 2 : 1)
    prefix_window_backward_kernel(SetSource states, SetSource grad_prefix, PrefixSink grad_states,
                                  float* grad_mixing, CausalWeights mix, int blocks, int state) {
  constexpr int M = W + 1, Group = backward_sweep_group(M), Slots = backward_sweep_slots(M);
  constexpr int Ahead = Slots - 1;
  __shared__ float ms[M * M];
  __shared__ float dm_row[M];  // this CTA's part of the sliding row's dm_{M-1, k}
  __shared__ float2 x_ring[Slots][kSweepThreads], s_ring[Slots][kSweepThreads];
  const int t = threadIdx.x, lane = t % 32;
  // Linear attention is the window W = 0 with weight 1 (and no mixing gradient).
  for (int i = t; i < M * M; i += kSweepThreads) ms[i] = mix.m != nullptr ? mix.m[i] : 1.f;
  for (int k = t; k < M; k += kSweepThreads) dm_row[k] = 0.f;
  __syncthreads();
  // The sliding row's weights stay in registers here: read from shared memory at four CTAs per
  // SM this sweep was slower (MHLA at T = 8,192: 422 -> 489 us, session 21 call 3).
  float c[W + 1];
#pragma unroll
  for (int d = 1; d <= W; ++d) c[d] = ms[(M - 1) * M + M - 1 - d];
  const float tail = ms[(M - 1) * M];
  const bool slides = mix.m != nullptr && blocks > M;
  float sliding[M];  // this thread's share of dm_{M-1, k}
#pragma unroll
  for (int k = 0; k < M; ++k) sliding[k] = 0.f;
  const int e = 2 * (blockIdx.x * kSweepThreads + t);
  // A lane past the state runs on zeros (the barrier at the end), copied as the state's last
  // pair is (an fp32 pair in a packed set too, as its unpacking reads it).
  const bool live = e < state;
  const int e_copy = live ? e : state - 2;
  const size_t first = static_cast<size_t>(blockIdx.y) * blocks;
  const PairColumn dp_column = grad_prefix.column(first, e_copy);
  const PairColumn s_column = states.column(first, e_copy);
  const PairColumn ds_column = grad_states.column(first, e_copy);
  // Block j (j % Slots == Slot) into its slots; one group per block, empty before the first.
  auto fetch = [&](int j, auto slot_constant) {
    constexpr int slot = decltype(slot_constant)::value;
    if (j >= 0) {
      copy_pair(&x_ring[slot][t], dp_column, j, live);
      if (slides) copy_pair(&s_ring[slot][t], s_column, j, live);  // for dm
    }
    async_copy::commit();
  };
  // dS_j = sum_{d=1}^{W} w(j+d, j) dP_{j+d} + tail * U_j, U_j = sum_{i >= j+M} dP_i, walking j
  // down. The same walk collects dm of the sliding rows (i >= M), so dP and S are each read
  // once: dm_{M-1, M-1-d} += dP_{j+d} . S_j and the tail's sum_i dP_i . R_i = sum_j S_j . U_j.
  // (The trained rows' pairs dm_{j+d, j}, j + d < M, summed here cost more than the separate
  // pair-products kernel: by a warp sum per pair and block, MHLA at T = 2,048 took 2.13 ms against
  // 1.52, session 22; by one warp reduce-scatter per block, this sweep took 662 us against 447,
  // session 23. Even compiled in behind a runtime switch, that path slowed the trained rows'
  // steps: 301 -> 447 us at T = 2,048.)
  // recent[b % M] = dP_b for the M blocks after j (zero past the last); at step j, recent[j % M]
  // still holds dP_{j+M}: it joins U, then dP_j takes its place.
  float2 recent[M];
#pragma unroll
  for (int k = 0; k < M; ++k) recent[k] = make_float2(0.f, 0.f);
  float2 u = make_float2(0.f, 0.f);
  // The first Ahead fetches: blocks down from the last, whose slot is not a constant.
  for (int a = 0; a < Ahead; ++a) {
    const int j = blocks - 1 - a;
    if (j >= 0) {
      copy_pair(&x_ring[j % Slots][t], dp_column, j, live);
      if (slides) copy_pair(&s_ring[j % Slots][t], s_column, j, live);
    }
    async_copy::commit();
  }
  // One step at block j, j % Group == k; Sliding: every w(j+d, j) is the sliding row's (j >= M).
  auto step = [&](int j, auto k_constant, auto sliding_rows) {
    constexpr int k = decltype(k_constant)::value, slot = k % Slots, r = k % M;
    constexpr bool all_sliding = decltype(sliding_rows)::value;
    async_copy::wait<Ahead - 1>();  // block j's group is done
    const float2 x = unpack_pair(&x_ring[slot][t], dp_column);
    const float2 s = slides ? unpack_pair(&s_ring[slot][t], s_column) : make_float2(0.f, 0.f);
    u.x += recent[r].x;
    u.y += recent[r].y;
    float2 g = make_float2(tail * u.x, tail * u.y);
#pragma unroll
    for (int d = 1; d <= W; ++d) {
      const float w = all_sliding || k + d >= M ? c[d] : ms[(k + d) * M + k];
      g.x = fmaf(w, recent[(r + d) % M].x, g.x);
      g.y = fmaf(w, recent[(r + d) % M].y, g.y);
    }
    if (slides) {
      // Two chained FMAs per product (a * b + c * d, then added, took three instructions).
      sliding[0] = fmaf(s.y, u.y, fmaf(s.x, u.x, sliding[0]));
#pragma unroll
      for (int d = 1; d <= W; ++d) {
        if (all_sliding || k + d >= M) {
          const float2 p = recent[(r + d) % M];
          sliding[M - 1 - d] = fmaf(s.y, p.y, fmaf(s.x, p.x, sliding[M - 1 - d]));
        }
      }
    }
    if (live) store_pair(ds_column, j, g);
    fetch(j - Ahead, std::integral_constant<int, (k + 1) % Slots>{});
    recent[r] = x;
  };
  // Groups of Group blocks from the one holding the last block down; the lowest (j < Group)
  // takes the trained rows' weights where j + d < M.
  for (int group = (blocks - 1) / Group * Group; group >= Group; group -= Group) {
    unrolled<Group>([&](auto q) {
      constexpr int k = Group - 1 - decltype(q)::value;
      if (group + k < blocks) step(group + k, std::integral_constant<int, k>{}, std::true_type{});
    });
  }
  unrolled<Group>([&](auto q) {
    constexpr int k = Group - 1 - decltype(q)::value;
    if (k < blocks) step(k, std::integral_constant<int, k>{}, std::false_type{});
  });
  if (!slides) return;
#pragma unroll
  for (int k = 0; k < M; ++k) {
    const float v = warp_sum(sliding[k]);
    if (lane == 0) atomicAdd(&dm_row[k], v);
  }
  __syncthreads();
  // One add per CTA and entry (parts per CTA summed by the caller cost a 21 us reduction kernel
  // at T = 2,048, session 23).
  for (int k = t; k < M; k += kSweepThreads) atomicAdd(grad_mixing + (M - 1) * M + k, dm_row[k]);
}

template <typename T, int D>
__host__ __device__ constexpr size_t key_backward_smem() {
  using L = Layout<T, D, kCausalThreads>;
  using E = typename Mma<T>::elem;
  return align128(D * L::lde * sizeof(E)) + 2 * align128(kC * L::lde * sizeof(E)) +
         2 * align128(kC * L::ldf * 4) + align128(D * 4) + align128(kC * 4);
}

// dk and dv of one block: V dS_j^T + dz_j and phi(K) dS_j, plus the intra-block parts the query
// pass left in grad_k (before the feature backward) and grad_v.
template <typename T, int D>
__global__ void __launch_bounds__(kCausalThreads) key_backward_kernel(CausalBlockLinearBackward p) {
  using L = Layout<T, D, kCausalThreads>;
  using E = typename Mma<T>::elem;
  extern __shared__ __align__(128) unsigned char smem[];
  SharedCursor cursor{smem};
  E* ds = cursor.take<E>(D * L::lde);
  E* kf = cursor.take<E>(kC * L::lde);
  E* vt = cursor.take<E>(kC * L::lde);
  float* dphi = cursor.take<float>(kC * L::ldf);
  float* dv = cursor.take<float>(kC * L::ldf);
  float* dz = cursor.take<float>(D);
  float* inv_rms = cursor.take<float>(kC);
  const BlockWork w = block_work(p.shape);
  const int blocks = blocks_of(p.shape.tokens);
  // k, v rows and dS in flight together; k's raw rows stay for the feature backward.
  TileRows<T, D, kCausalThreads> k_rows;
  {
    TileRows<T, D, kCausalThreads> v_rows;
    k_rows.load(p.k, w.b, w.h, w.begin, w.valid, kC);
    v_rows.load(p.v, w.b, w.h, w.begin, w.valid, kC);
    load_state<T, D, kCausalThreads>(p.grad_states + state_offset(w, blocks, L::state), ds, dz);
    k_rows.store_features(w.valid, kC, kf, inv_rms);
    v_rows.store_plain(kC, vt);
  }
  T* grad_k = static_cast<T*>(p.grad_k);
  T* grad_v = static_cast<T*>(p.grad_v);
  // The query pass's intra-block parts of dk and dv: issued here, used after the products.
  TileRows<T, D, kCausalThreads> dk_part, dv_part;
  dk_part.load_contiguous(grad_k, p.shape.tokens, p.shape.heads, w.b, w.h, w.begin, w.valid);
  dv_part.load_contiguous(grad_v, p.shape.tokens, p.shape.heads, w.b, w.h, w.begin, w.valid);
  __syncthreads();
  multiply_tile<T, D, true, kCausalThreads>(vt, ds, dphi, kC);  // d(phi(k)) = V dS^T (+ dz below)
  multiply_tile<T, D, false, kCausalThreads>(kf, ds, dv, kC);   // dV = phi(K) dS
  __syncthreads();
  const int lane = threadIdx.x % L::lanes;
#pragma unroll
  for (int pass = 0; pass < TileRows<T, D, kCausalThreads>::passes; ++pass) {  // whole warps
    const int r = TileRows<T, D, kCausalThreads>::row(pass);
    if (r >= kC) break;
    float x[L::vec], g[L::vec], part[L::vec];
    const bool live = r < w.valid;
    const size_t row = out_row(p.shape, w, r);
    k_rows.values(pass, x);
    if (live) {
      dv_part.values(pass, part);
#pragma unroll
      for (int i = 0; i < L::vec; ++i) g[i] = dv[r * L::ldf + lane * L::vec + i] + part[i];
      store_vector<T, D>(grad_v + row * D + lane * L::vec, g);
      dk_part.values(pass, part);
    }
#pragma unroll
    for (int i = 0; i < L::vec; ++i) {
      const int d = lane * L::vec + i;
      if (!live) x[i] = 0.f;
      g[i] = live ? dphi[r * L::ldf + d] + dz[d] + part[i] : 0.f;
    }
    feature_backward<T, D, kCausalThreads>(x, live ? inv_rms[r] : 0.f, g);
    if (live) store_vector<T, D>(grad_k + row * D + lane * L::vec, g);
  }
}

template <typename T, int D>
__host__ __device__ constexpr size_t lean_query_backward_smem() {
  using L = Layout<T, D, kLeanThreads>;
  using E = typename Mma<T>::elem;
  constexpr size_t tile = kC * L::lde * sizeof(E);
  constexpr size_t prefix = D * L::lde * sizeof(E), dphi = kC * L::ldf * 4;
  constexpr size_t masks = 2 * kC * kLdScoreE * sizeof(E);
  return align128(prefix > dphi ? prefix : dphi) + 3 * align128(tile) +
         align128(tile > masks ? tile : masks) + align128(D * 4) + 5 * align128(kC * 4) +
         align128(kLeanWarps * 4);
}

// query_backward_kernel for 16-bit T at two CTAs per SM. The score and g tiles stay in the
// registers of the warp that made them (the scores' tile assignment of lean_output_kernel);
// buffers are reused once their last reader has passed a barrier: V's tile takes the two masked
// score tiles, P's the fp32 d(phi(q)) and then dv's rows, phi(K)'s dk's rows.
template <typename T, int D>
__global__ void __launch_bounds__(kLeanThreads, 2)
    lean_query_backward_kernel(CausalBlockLinearBackward p) {
  using L = Layout<T, D, kLeanThreads>;
  using E = typename Mma<T>::elem;
  using Rows = TileRows<T, D, kLeanThreads>;
  using Tiles = LeanTokenTiles<D>;
  using wmma_tiles::TileAccumulator;
  extern __shared__ __align__(128) unsigned char smem[];
  SharedCursor cursor{smem};
  constexpr size_t prefix_floats =
      (D * L::lde * sizeof(E) > kC * L::ldf * 4) ? (D * L::lde * sizeof(E) + 3) / 4 : kC * L::ldf;
  float* prefix_area = cursor.take<float>(prefix_floats);
  E* prefix = reinterpret_cast<E*>(prefix_area);
  E* qf = cursor.take<E>(kC * L::lde);
  E* kf = cursor.take<E>(kC * L::lde);
  E* dnum = cursor.take<E>(kC * L::lde);
  constexpr int v_elems = kC * L::lde > 2 * kC * kLdScoreE ? kC * L::lde : 2 * kC * kLdScoreE;
  E* vt = cursor.take<E>(v_elems);
  E* g_masked = vt;  // after V's last reader
  E* scores_masked = vt + kC * kLdScoreE;
  float* z = cursor.take<float>(D);
  float* inv_rms = cursor.take<float>(kC);
  float* qz = cursor.take<float>(kC);
  float* dden = cursor.take<float>(kC);
  float* row_part = cursor.take<float>(2 * kC);
  float* warp_partial = cursor.take<float>(kLeanWarps);
  const BlockWork w = block_work(p.shape);
  const int blocks = blocks_of(p.shape.tokens);
  const CausalWeights mix{p.mixing, p.shape.mixing_blocks};
  const float diagonal_weight = mix.at(w.block, w.block);
  const size_t offset = state_offset(w, blocks, set_floats(D, p.packed_grad_prefix));
  const size_t prefix_block = static_cast<size_t>(w.bh) * blocks + w.block;
  if (p.packed_prefix) start_prefix_load<T, D>(p.prefix, true, prefix_block, prefix, z);
  Rows q_rows;  // raw q for the feature backward at the end
  {
    Rows k_rows, v_rows;
    q_rows.load(p.q, w.b, w.h, w.begin, w.valid, kC);
    k_rows.load(p.k, w.b, w.h, w.begin, w.valid, kC);
    v_rows.load(p.v, w.b, w.h, w.begin, w.valid, kC);
    if (!p.packed_prefix) start_prefix_load<T, D>(p.prefix, false, prefix_block, prefix, z);
    q_rows.store_features(w.valid, kC, qf, inv_rms);
    k_rows.store_features(w.valid, kC, kf, nullptr);
    v_rows.store_plain(kC, vt);
  }
  Rows go_rows, o_rows;  // used after the scores
  go_rows.load(p.grad_out, w.b, w.h, w.begin, w.valid, kC);
  o_rows.load(p.out, w.b, w.h, w.begin, w.valid, kC);
  wait_copies();
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  ScoreTiles scores;
  scores.multiply(qf, L::lde, kf, L::lde, D);
  scores.mask_and_sum_rows(row_part);
  rows_dot_z<E, D, L::lde>(qf, z, qz);
  __syncthreads();
  // d(numerator) = dO / den; d(den) = -(dO . o) / den.
  const int row_lane = threadIdx.x % L::lanes;
#pragma unroll
  for (int pass = 0; pass < Rows::passes; ++pass) {
    const int r = Rows::row(pass);
    if (r >= kC) break;
    const float den = qz[r] + diagonal_weight * (row_part[r] + row_part[kC + r]) + kDenominatorEps;
    float go[L::vec], o[L::vec];
    float dot = 0.f;
    if (r < w.valid) {
      go_rows.values(pass, go);
      o_rows.values(pass, o);
      const float inv = 1.f / den;
#pragma unroll
      for (int i = 0; i < L::vec; ++i) {
        dot += go[i] * o[i];
        go[i] *= inv;
      }
    } else {
#pragma unroll
      for (int i = 0; i < L::vec; ++i) go[i] = 0.f;
    }
    dot = row_sum<L::lanes>(dot);
    store_pack<E, L::vec>(dnum + r * L::lde + row_lane * L::vec, go);
    if (row_lane == 0) dden[r] = r < w.valid ? -dot / den : 0.f;
  }
  __syncthreads();
  // g' = dnum . v_s + dden_t on the mask; dm_ii = sum g' * (phi(q_t) . phi(k_s)).
  ScoreTiles g;
  g.multiply(dnum, L::lde, vt, L::lde, D);
  float diagonal_grad = 0.f;
#pragma unroll
  for (int j = 0; j < 2; ++j) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float gr = g.on_mask(j, h, i) ? g.t[0][j].x[h][i] + dden[g.token_row(i)] : 0.f;
        g.t[0][j].x[h][i] = gr;
        diagonal_grad += gr * scores.t[0][j].x[h][i];
      }
    }
  }
  diagonal_grad = warp_sum(diagonal_grad);
  if (lane == 0) warp_partial[warp] = diagonal_grad;
  __syncthreads();  // V's last reader is done: its tile takes the masked tiles
  g.store_scaled(g_masked, diagonal_weight);
  scores.store_scaled(scores_masked, diagonal_weight);
  if (threadIdx.x == 0 && p.mixing != nullptr) {
    float sum = 0.f;
    for (int i = 0; i < kLeanWarps; ++i) sum += warp_partial[i];
    add_diagonal_grad(p, mix, w.block, sum);
  }
  __syncthreads();
  // d(phi(q)) = dnum P^T + g'_masked phi(K) (+ dden z^T in the row loop).
  const int fm = Tiles::first_row_tile(), fn = Tiles::first_col_tile();
  TileAccumulator acc[Tiles::rows][Tiles::cols];
#pragma unroll
  for (int i = 0; i < Tiles::rows; ++i) {
#pragma unroll
    for (int j = 0; j < Tiles::cols; ++j) acc[i][j].zero();
  }
  wmma_tiles::mma_block<E, false, true, Tiles::rows, Tiles::cols>(acc, dnum, L::lde, prefix, L::lde,
                                                                  fm, fn, D);
  wmma_tiles::mma_block<E, false, false, Tiles::rows, Tiles::cols>(
      acc, g_masked, kLdScoreE, kf, L::lde, fm, fn, (fm + Tiles::rows) * 16);
  __syncthreads();  // P's and phi(K)'s last readers are done
  float* dphi = prefix_area;
#pragma unroll
  for (int i = 0; i < Tiles::rows; ++i) {
#pragma unroll
    for (int j = 0; j < Tiles::cols; ++j) {
      acc[i][j].store(dphi + (fm + i) * 16 * L::ldf + (fn + j) * 16, L::ldf);
    }
  }
  // dP_i = phi(Q)^T dnum straight to its state (packed: the matrix in bf16, as the prefix sweep
  // and the pair products only sum it in fp32); dz_i = phi(Q)^T dden in fp32.
  if (p.packed_grad_prefix) {
    wmma_tiles::gemm_blocked<E, kLeanWarps, true, false>(
        qf, L::lde, dnum, L::lde, reinterpret_cast<__nv_bfloat16*>(p.grad_prefix + offset), D, D, D,
        kC);
  } else {
    wmma_tiles::gemm_blocked<E, kLeanWarps, true, false>(
        qf, L::lde, dnum, L::lde, p.grad_prefix + offset, D, D, D, kC, false);
  }
  if (threadIdx.x < D) {
    float dz = 0.f;
    for (int r = 0; r < w.valid; ++r) dz += to_float(qf[r * L::lde + threadIdx.x]) * dden[r];
    p.grad_prefix[offset + (p.packed_grad_prefix ? D * D / 2 : D * D) + threadIdx.x] = dz;
  }
  // The intra-block part of d(phi(k)) = g'_masked^T phi(Q) into phi(K)'s tile (rows s take
  // queries t >= s only).
  auto intra_part = [&](const E* a, const E* b, E* stage) {
#pragma unroll
    for (int i = 0; i < Tiles::rows; ++i) {
#pragma unroll
      for (int j = 0; j < Tiles::cols; ++j) acc[i][j].zero();
    }
    const int k0 = fm * 16;
    wmma_tiles::mma_block<E, true, false, Tiles::rows, Tiles::cols>(
        acc, a + k0 * kLdScoreE, kLdScoreE, b + k0 * L::lde, L::lde, fm, fn, kC - k0);
#pragma unroll
    for (int i = 0; i < Tiles::rows; ++i) {
#pragma unroll
      for (int j = 0; j < Tiles::cols; ++j) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
#pragma unroll
          for (int e = 0; e < 4; e += 2) {
            const int r = (fm + i) * 16 + TileAccumulator::row(e);
            const int c = (fn + j) * 16 + TileAccumulator::col(h, e);
            store_pair(stage + r * L::lde + c, acc[i][j].x[h][e], acc[i][j].x[h][e + 1]);
          }
        }
      }
    }
  };
  intra_part(g_masked, qf, kf);
  __syncthreads();
  T* grad_q = static_cast<T*>(p.grad_q);
  T* grad_k = static_cast<T*>(p.grad_k);
  T* grad_v = static_cast<T*>(p.grad_v);
#pragma unroll
  for (int pass = 0; pass < Rows::passes; ++pass) {  // whole warps (feature_backward shuffles)
    const int r = Rows::row(pass);
    if (r >= kC) break;
    float x[L::vec], gq[L::vec];
    const bool live = r < w.valid;
    q_rows.values(pass, x);
#pragma unroll
    for (int i = 0; i < L::vec; ++i) {
      const int d = row_lane * L::vec + i;
      if (!live) x[i] = 0.f;
      gq[i] = live ? dphi[r * L::ldf + d] + dden[r] * z[d] : 0.f;
    }
    feature_backward<T, D, kLeanThreads>(x, live ? inv_rms[r] : 0.f, gq);
    if (live) store_vector<T, D>(grad_q + out_row(p.shape, w, r) * D + row_lane * L::vec, gq);
  }
  for (int r = threadIdx.x / L::lanes; r < w.valid; r += L::rows_per_pass) {
    *reinterpret_cast<uint4*>(grad_k + out_row(p.shape, w, r) * D + row_lane * L::vec) =
        *reinterpret_cast<const uint4*>(kf + r * L::lde + row_lane * L::vec);
  }
  __syncthreads();                          // d(phi(q))'s rows are read: P's area takes dv's
  intra_part(scores_masked, dnum, prefix);  // dv = masked^T dnum
  __syncthreads();
  for (int r = threadIdx.x / L::lanes; r < w.valid; r += L::rows_per_pass) {
    *reinterpret_cast<uint4*>(grad_v + out_row(p.shape, w, r) * D + row_lane * L::vec) =
        *reinterpret_cast<const uint4*>(prefix + r * L::lde + row_lane * L::vec);
  }
}

template <typename T, int D>
__host__ __device__ constexpr size_t lean_key_backward_smem() {
  using L = Layout<T, D, kLeanThreads>;
  using E = typename Mma<T>::elem;
  return align128(D * L::lde * sizeof(E)) + 2 * align128(kC * L::lde * sizeof(E)) +
         align128(kC * L::ldf * 4) + align128(D * 4) + align128(kC * 4);
}

// key_backward_kernel for 16-bit T at two CTAs per SM: dv, then d(phi(k)), through one fp32 tile.
template <typename T, int D>
__global__ void __launch_bounds__(kLeanThreads, 2)
    lean_key_backward_kernel(CausalBlockLinearBackward p) {
  using L = Layout<T, D, kLeanThreads>;
  using E = typename Mma<T>::elem;
  using Rows = TileRows<T, D, kLeanThreads>;
  using Tiles = LeanTokenTiles<D>;
  using wmma_tiles::TileAccumulator;
  extern __shared__ __align__(128) unsigned char smem[];
  SharedCursor cursor{smem};
  E* ds = cursor.take<E>(D * L::lde);
  E* kf = cursor.take<E>(kC * L::lde);
  E* vt = cursor.take<E>(kC * L::lde);
  float* product = cursor.take<float>(kC * L::ldf);
  float* dz = cursor.take<float>(D);
  float* inv_rms = cursor.take<float>(kC);
  const BlockWork w = block_work(p.shape);
  const int blocks = blocks_of(p.shape.tokens);
  const size_t ds_block = static_cast<size_t>(w.bh) * blocks + w.block;
  if (p.packed_grad_states) start_prefix_load<T, D>(p.grad_states, true, ds_block, ds, dz);
  Rows k_rows;  // raw k for the feature backward
  {
    Rows v_rows;
    k_rows.load(p.k, w.b, w.h, w.begin, w.valid, kC);
    v_rows.load(p.v, w.b, w.h, w.begin, w.valid, kC);
    if (!p.packed_grad_states) start_prefix_load<T, D>(p.grad_states, false, ds_block, ds, dz);
    k_rows.store_features(w.valid, kC, kf, inv_rms);
    v_rows.store_plain(kC, vt);
  }
  T* grad_k = static_cast<T*>(p.grad_k);
  T* grad_v = static_cast<T*>(p.grad_v);
  // The query pass's intra-block parts: in flight during the products.
  Rows dk_part, dv_part;
  dk_part.load_contiguous(grad_k, p.shape.tokens, p.shape.heads, w.b, w.h, w.begin, w.valid);
  dv_part.load_contiguous(grad_v, p.shape.tokens, p.shape.heads, w.b, w.h, w.begin, w.valid);
  wait_copies();
  __syncthreads();
  const int fm = Tiles::first_row_tile(), fn = Tiles::first_col_tile();
  // product = A B (B = dS, transposed when Transposed), from this warp's tile block.
  auto multiply = [&](const E* a, auto transposed) {
    TileAccumulator acc[Tiles::rows][Tiles::cols];
#pragma unroll
    for (int i = 0; i < Tiles::rows; ++i) {
#pragma unroll
      for (int j = 0; j < Tiles::cols; ++j) acc[i][j].zero();
    }
    wmma_tiles::mma_block<E, false, decltype(transposed)::value, Tiles::rows, Tiles::cols>(
        acc, a, L::lde, ds, L::lde, fm, fn, D);
#pragma unroll
    for (int i = 0; i < Tiles::rows; ++i) {
#pragma unroll
      for (int j = 0; j < Tiles::cols; ++j) {
        acc[i][j].store(product + (fm + i) * 16 * L::ldf + (fn + j) * 16, L::ldf);
      }
    }
  };
  multiply(kf, std::false_type{});  // dV = phi(K) dS
  __syncthreads();
  const int row_lane = threadIdx.x % L::lanes;
#pragma unroll
  for (int pass = 0; pass < Rows::passes; ++pass) {
    const int r = Rows::row(pass);
    if (r >= w.valid) break;
    float g[L::vec], part[L::vec];
    dv_part.values(pass, part);
#pragma unroll
    for (int i = 0; i < L::vec; ++i) g[i] = product[r * L::ldf + row_lane * L::vec + i] + part[i];
    store_vector<T, D>(grad_v + out_row(p.shape, w, r) * D + row_lane * L::vec, g);
  }
  __syncthreads();
  multiply(vt, std::true_type{});  // d(phi(k)) = V dS^T (+ dz below)
  __syncthreads();
#pragma unroll
  for (int pass = 0; pass < Rows::passes; ++pass) {  // whole warps
    const int r = Rows::row(pass);
    if (r >= kC) break;
    float x[L::vec], g[L::vec], part[L::vec];
    const bool live = r < w.valid;
    k_rows.values(pass, x);
    dk_part.values(pass, part);
#pragma unroll
    for (int i = 0; i < L::vec; ++i) {
      const int d = row_lane * L::vec + i;
      if (!live) x[i] = 0.f;
      g[i] = live ? product[r * L::ldf + d] + dz[d] + part[i] : 0.f;
    }
    feature_backward<T, D, kLeanThreads>(x, live ? inv_rms[r] : 0.f, g);
    if (live) store_vector<T, D>(grad_k + out_row(p.shape, w, r) * D + row_lane * L::vec, g);
  }
}

// Two lean CTAs per SM at the largest head dimension (each CTA also reserves 1 KB).
static_assert(2 * (lean_output_smem<__nv_bfloat16, 128>() + 1024) <= 228 * 1024);
static_assert(2 * (lean_query_backward_smem<__nv_bfloat16, 128>() + 1024) <= 228 * 1024);
static_assert(2 * (lean_key_backward_smem<__nv_bfloat16, 128>() + 1024) <= 228 * 1024);

// ---------------------------------------------------------------------------------------------
// Launchers

// The lean token passes for 16-bit types (fp32 keeps the WMMA tf32 passes);
// MHLA_CAUSAL_LEAN_PASSES=0 returns to the one-CTA-per-SM passes for A/B runs.
template <typename T>
bool lean_passes() {
  if constexpr (std::is_same_v<T, float>) {
    return false;
  } else {
    static const bool on = [] {
      const char* value = std::getenv("MHLA_CAUSAL_LEAN_PASSES");
      return value == nullptr || value[0] != '0';
    }();
    return on;
  }
}

int window_of(const float* mixing, int mixing_blocks) {
  return mixing == nullptr ? 0 : mixing_blocks - 1;
}

// The prefix sweeps with a compile-time window, for the windows they are built for.
// The forward sweep's load depth: MHLA_SWEEP_AHEAD = 1, 3, 7 or 15 (rings of 2, 4, 8 or 16
// slots: constant slot indices where M is a multiple), else the default. (The backward sweep's
// depth follows from its window: backward_sweep_slots.)
int sweep_ahead() {
  static const int ahead = [] {
    const char* value = std::getenv("MHLA_SWEEP_AHEAD");
    const int forced = value != nullptr ? std::atoi(value) : 0;
    return forced == 1 || forced == 3 || forced == 7 || forced == 15 ? forced : kSweepAhead;
  }();
  return ahead;
}

// Calls f(std::integral_constant<int, A>) for the forward sweep's depth A.
template <typename F>
cudaError_t with_sweep_ahead(F&& f) {
  switch (sweep_ahead()) {
    case 1:
      return f(std::integral_constant<int, 1>{});
    case 3:
      return f(std::integral_constant<int, 3>{});
    case 15:
      return f(std::integral_constant<int, 15>{});
    default:
      return f(std::integral_constant<int, 7>{});
  }
}

template <int W>
struct PrefixWindowForward {
  static cudaError_t run(const CausalBlockLinearForward& a, cudaStream_t stream, int state) {
    const auto& s = a.shape;
    const int pairs = state / 2;  // two elements per thread
    return with_sweep_ahead([&](auto ahead) {
      prefix_window_kernel<W, decltype(ahead)::value>
          <<<dim3((pairs + kSweepThreads - 1) / kSweepThreads, s.batch * s.heads), kSweepThreads, 0,
             stream>>>(set_source(a.states, s.head_dim, a.packed_states),
                       prefix_sink(a.prefix, s.head_dim, a.packed_prefix),
                       CausalWeights{a.mixing, s.mixing_blocks}, blocks_of(s.tokens), state);
      return cudaGetLastError();
    });
  }
};

template <int W>
struct PrefixWindowBackward {
  static cudaError_t run(const CausalBlockLinearBackward& a, cudaStream_t stream, int state) {
    const auto& s = a.shape;
    const int pairs = state / 2;  // two elements per thread
    prefix_window_backward_kernel<W>
        <<<dim3((pairs + kSweepThreads - 1) / kSweepThreads, s.batch * s.heads), kSweepThreads, 0,
           stream>>>(set_source(a.states, s.head_dim, a.packed_states),
                     set_source(a.grad_prefix, s.head_dim, a.packed_grad_prefix),
                     prefix_sink(a.grad_states, s.head_dim, a.packed_grad_states), a.grad_mixing,
                     CausalWeights{a.mixing, s.mixing_blocks}, blocks_of(s.tokens), state);
    return cudaGetLastError();
  }
};

// Runs Pass<W> and returns true when the window has a compile-time kernel (linear attention's
// running sum is W = 0); false otherwise (other windows take the generic shared-memory sweep).
template <template <int> class Pass, typename Args>
bool prefix_by_window(int window, const Args& a, cudaStream_t stream, cudaError_t* err) {
  const int state = a.shape.head_dim * a.shape.head_dim + a.shape.head_dim;
  switch (window) {
    case 0:  // linear attention: the running sum
      *err = Pass<0>::run(a, stream, state);
      return true;
    case 2:
      *err = Pass<2>::run(a, stream, state);
      return true;
    case 3:
      *err = Pass<3>::run(a, stream, state);
      return true;
    case 7:
      *err = Pass<7>::run(a, stream, state);
      return true;
    case 15:
      *err = Pass<15>::run(a, stream, state);
      return true;
    case 31:
      *err = Pass<31>::run(a, stream, state);
      return true;
    default:
      return false;
  }
}

template <typename T, int D>
cudaError_t forward_for(const CausalBlockLinearForward& a, cudaStream_t stream) {
  const auto& s = a.shape;
  const int blocks = blocks_of(s.tokens), state = Layout<T, D, kCausalThreads>::state;
  const dim3 grid(blocks, s.batch * s.heads);
  cudaError_t err = cudaSuccess;
  bool states_done = false;
  if constexpr (!std::is_same_v<T, float>) {
    if ((a.passes & kCausalStatesPass) && lean_passes<T>()) {
      constexpr size_t bytes = lean_states_smem<T, D>();
      if ((err = allow_smem(lean_states_kernel<T, D>, bytes)) != cudaSuccess) return err;
      lean_states_kernel<T, D><<<grid, kLeanThreads, bytes, stream>>>(a);
      states_done = true;
    }
  }
  if ((a.passes & kCausalStatesPass) && !states_done) {
    constexpr size_t bytes = states_smem<T, D>();
    if ((err = allow_smem(states_kernel<T, D>, bytes)) != cudaSuccess) return err;
    states_kernel<T, D><<<grid, kCausalThreads, bytes, stream>>>(a);
  }
  if ((a.passes & kCausalPrefixPass) &&
      prefix_by_window<PrefixWindowForward>(window_of(a.mixing, s.mixing_blocks), a, stream,
                                            &err)) {
    if (err != cudaSuccess) return err;
  } else if (a.passes & kCausalPrefixPass) {
    const int window = window_of(a.mixing, s.mixing_blocks);
    const size_t bytes = (static_cast<size_t>(window + 1) * (window + 1) +
                          (window > 0 ? window : 1) * kSweepThreads) *
                         4;
    if ((err = allow_smem(prefix_kernel, bytes)) != cudaSuccess) return err;
    prefix_kernel<<<dim3((state + kSweepThreads - 1) / kSweepThreads, s.batch * s.heads),
                    kSweepThreads, bytes, stream>>>(
        set_source(a.states, s.head_dim, a.packed_states),
        prefix_sink(a.prefix, s.head_dim, a.packed_prefix),
        CausalWeights{a.mixing, s.mixing_blocks}, blocks, state);
  }
  bool output_done = false;
  if constexpr (!std::is_same_v<T, float>) {
    if ((a.passes & kCausalOutputPass) && lean_passes<T>()) {
      constexpr size_t bytes = lean_output_smem<T, D>();
      if ((err = allow_smem(lean_output_kernel<T, D>, bytes)) != cudaSuccess) return err;
      lean_output_kernel<T, D><<<grid, kLeanThreads, bytes, stream>>>(a);
      output_done = true;
    }
  }
  if ((a.passes & kCausalOutputPass) && !output_done) {
    constexpr size_t bytes = output_smem<T, D>();
    if ((err = allow_smem(output_kernel<T, D>, bytes)) != cudaSuccess) return err;
    output_kernel<T, D><<<grid, kCausalThreads, bytes, stream>>>(a);
  }
  return cudaGetLastError();
}

template <typename T, int D>
cudaError_t backward_for(const CausalBlockLinearBackward& a, cudaStream_t stream) {
  const auto& s = a.shape;
  const int blocks = blocks_of(s.tokens), state = Layout<T, D, kCausalThreads>::state;
  const dim3 grid(blocks, s.batch * s.heads);
  const int m = s.mixing_blocks;
  cudaError_t err = cudaSuccess;
  if (a.passes & kCausalQueryPass) {
    if (a.mixing != nullptr &&
        (err = cudaMemsetAsync(a.grad_mixing, 0, sizeof(float) * m * m, stream)) != cudaSuccess)
      return err;
    bool done = false;
    if constexpr (!std::is_same_v<T, float>) {
      if (lean_passes<T>()) {
        constexpr size_t bytes = lean_query_backward_smem<T, D>();
        if ((err = allow_smem(lean_query_backward_kernel<T, D>, bytes)) != cudaSuccess) return err;
        lean_query_backward_kernel<T, D><<<grid, kLeanThreads, bytes, stream>>>(a);
        done = true;
      }
    }
    if (!done) {
      constexpr size_t bytes = query_backward_smem<T, D>();
      if ((err = allow_smem(query_backward_kernel<T, D>, bytes)) != cudaSuccess) return err;
      query_backward_kernel<T, D><<<grid, kCausalThreads, bytes, stream>>>(a);
    }
  }
  if ((a.passes & kCausalPrefixPass) &&
      prefix_by_window<PrefixWindowBackward>(window_of(a.mixing, m), a, stream, &err)) {
    if (err != cudaSuccess) return err;
  } else if (a.passes & kCausalPrefixPass) {
    const int window = window_of(a.mixing, m), mm = window + 1;
    const size_t bytes = (static_cast<size_t>(mm) * mm + (window > 0 ? window : 1) * kSweepThreads +
                          static_cast<size_t>(mm) * kSweepThreads + mm) *
                         4;
    if ((err = allow_smem(prefix_backward_kernel, bytes)) != cudaSuccess) return err;
    // As many resident CTAs as shared memory allows: each thread's sweep waits on its loads.
    const int per_sm =
        static_cast<int>(std::max<size_t>(1, std::min<size_t>(8, kMaxSharedBytes / bytes)));
    const int items = s.batch * s.heads * ((state + kSweepThreads - 1) / kSweepThreads);
    const int ctas = std::min(items, per_sm * multiprocessors());
    prefix_backward_kernel<<<ctas, kSweepThreads, bytes, stream>>>(
        set_source(a.states, s.head_dim, a.packed_states),
        set_source(a.grad_prefix, s.head_dim, a.packed_grad_prefix),
        prefix_sink(a.grad_states, s.head_dim, a.packed_grad_states), a.grad_mixing,
        CausalWeights{a.mixing, m}, s.batch * s.heads, blocks, state);
  }
  bool key_done = false;
  if constexpr (!std::is_same_v<T, float>) {
    if ((a.passes & kCausalKeyPass) && lean_passes<T>()) {
      constexpr size_t bytes = lean_key_backward_smem<T, D>();
      if ((err = allow_smem(lean_key_backward_kernel<T, D>, bytes)) != cudaSuccess) return err;
      lean_key_backward_kernel<T, D><<<grid, kLeanThreads, bytes, stream>>>(a);
      key_done = true;
    }
  }
  if ((a.passes & kCausalKeyPass) && !key_done) {
    constexpr size_t bytes = key_backward_smem<T, D>();
    if ((err = allow_smem(key_backward_kernel<T, D>, bytes)) != cudaSuccess) return err;
    key_backward_kernel<T, D><<<grid, kCausalThreads, bytes, stream>>>(a);
  }
  return cudaGetLastError();
}

template <typename T, int D>
struct ForwardPass {
  static cudaError_t run(const CausalBlockLinearForward& a, cudaStream_t s) {
    return forward_for<T, D>(a, s);
  }
};
template <typename T, int D>
struct BackwardPass {
  static cudaError_t run(const CausalBlockLinearBackward& a, cudaStream_t s) {
    return backward_for<T, D>(a, s);
  }
};

}  // namespace

int causal_blocks(int tokens) {
  return blocks_of(tokens);
}

bool causal_prefix_packed(DType dtype) {
  // MHLA_CAUSAL_PACKED_PREFIX=0 keeps fp32 prefixes on the lean passes (A/B runs).
  static const bool allowed = [] {
    const char* value = std::getenv("MHLA_CAUSAL_PACKED_PREFIX");
    return value == nullptr || value[0] != '0';
  }();
  return allowed && dtype == DType::bf16 && lean_passes<__nv_bfloat16>();
}

int64_t causal_prefix_floats(int head_dim, bool packed) {
  return set_floats(head_dim, packed);
}

bool causal_block_linear_supported(const CausalBlockLinearShape& s, DType dtype) {
  const bool dim_ok = s.head_dim == 32 || s.head_dim == 64 || s.head_dim == 128;
  // fp32 tiles at D = 128 need more shared memory than an SM has (the query pass: ~390 KB).
  const bool fits = !(dtype == DType::f32 && s.head_dim == 128) &&
                    query_backward_smem<__nv_bfloat16, 128>() <= kMaxSharedBytes;
  return dim_ok && fits && s.batch > 0 && s.heads > 0 && s.tokens > 0 &&
         static_cast<int64_t>(s.batch) * s.heads <= 65535 && s.mixing_blocks >= 1 &&
         s.mixing_blocks <= 64;
}

cudaError_t causal_block_linear_forward(const CausalBlockLinearForward& args, cudaStream_t stream) {
  if (!causal_block_linear_supported(args.shape, args.dtype)) return cudaErrorInvalidValue;
  if ((args.packed_prefix || args.packed_states) && !causal_prefix_packed(args.dtype))
    return cudaErrorInvalidValue;
  if (args.mixing == nullptr && args.shape.mixing_blocks != 1) return cudaErrorInvalidValue;
  auto run = launcher_for<CausalBlockLinearForward, ForwardPass>(args.dtype, args.shape.head_dim);
  return run != nullptr ? run(args, stream) : cudaErrorInvalidValue;
}

cudaError_t causal_block_linear_backward(const CausalBlockLinearBackward& args,
                                         cudaStream_t stream) {
  if (!causal_block_linear_supported(args.shape, args.dtype)) return cudaErrorInvalidValue;
  if ((args.packed_prefix || args.packed_grad_states || args.packed_states ||
       args.packed_grad_prefix) &&
      !causal_prefix_packed(args.dtype))
    return cudaErrorInvalidValue;
  if (args.mixing == nullptr && args.shape.mixing_blocks != 1) return cudaErrorInvalidValue;
  auto run = launcher_for<CausalBlockLinearBackward, BackwardPass>(args.dtype, args.shape.head_dim);
  return run != nullptr ? run(args, stream) : cudaErrorInvalidValue;
}

}  // namespace mhla_kernels
