// Block linear attention (linear attention and bidirectional MHLA), forward and backward.
//
// Six kernels (the two mixing passes only for MHLA); each reads its token tensors once (the
// backward epilogues read a tile's q or k rows again, from cache):
//   forward   states  : S_j += phi(K)^T [V, 1] per (batch*head, block, chunk of 256 tokens)
//             mix     : S'_i = sum_j m_ij S_j                     (MHLA only)
//             output  : o = phi(Q) S'_i / (phi(Q) z'_i + eps)      per (batch*head, block, chunk)
//   backward  query   : dq, dS'_i = phi(Q)^T dO/den, dz'_i         per (batch*head, block, chunk)
//             mix     : dS_j = sum_i m_ij dS'_i, dm_ij = sum <dS'_i, S_j>   (MHLA only)
//             key     : dk, dv from dS_j, dz_j                     per (batch*head, block, chunk)
// The feature map (RMSNorm without weight, relu, floor), the normalizer and their backward passes
// are applied while tiles are loaded or written; products run on tensor cores (WMMA; tf32 for
// fp32 inputs) from shared memory with fp32 accumulation. States stay fp32 in global memory.
#include <cstdlib>
#include <string>
#include <type_traits>

#include "column_sum/column_sum.h"
#include "common/device_info.h"
#include "mhla/block_fragment_passes.h"
#include "mhla/block_linear_attention.h"
#include "mhla/block_work.cuh"
#include "mhla/state_tiles.cuh"
#include "mhla/tiles.cuh"

namespace mhla_kernels {
namespace {

using namespace tiles;

template <typename T, int D>
__host__ __device__ constexpr size_t states_smem() {
  using L = Layout<T, D>;
  return 2 * align128(kTile * L::lde * sizeof(typename Mma<T>::elem)) + kWarps * 256 * 4;
}

// Four CTAs per multiprocessor (64 registers): the pass waits on its loads, so occupancy
// is what hides them.
template <typename T, int D>
__global__ void __launch_bounds__(kThreads, 4) states_kernel(BlockLinearForward p, int chunks) {
  using L = Layout<T, D>;
  using E = typename Mma<T>::elem;
  extern __shared__ __align__(128) unsigned char smem[];
  E* kf = reinterpret_cast<E*>(smem);
  E* vt = reinterpret_cast<E*>(smem + align128(kTile * L::lde * sizeof(E)));
  float* staging = reinterpret_cast<float*>(smem + 2 * align128(kTile * L::lde * sizeof(E)));
  const Work w = work_of(p.shape, chunks);

  FragC<T> acc[L::frags_per_warp];
#pragma unroll
  for (int u = 0; u < L::frags_per_warp; ++u) wmma::fill_fragment(acc[u], 0.f);
  float z = 0.f;  // thread d < D: sum of phi(k)[d]
  // The next tile's k and v rows are loaded into registers while this tile's product runs.
  TileRows<T, D> k_rows, v_rows;
  auto issue = [&](int n0) {
    const int valid = min(kTile, w.end - n0), rows = (valid + 15) / 16 * 16;
    k_rows.load(p.k, w.b, w.h, n0, valid, rows);
    v_rows.load(p.v, w.b, w.h, n0, valid, rows);
  };
  if (w.begin < w.end) issue(w.begin);
  for (int n0 = w.begin; n0 < w.end; n0 += kTile) {
    const int valid = min(kTile, w.end - n0), rows = (valid + 15) / 16 * 16;
    __syncthreads();
    k_rows.store_features(valid, rows, kf, nullptr);
    v_rows.store_plain(rows, vt);
    if (n0 + kTile < w.end) issue(n0 + kTile);
    __syncthreads();
    if (threadIdx.x < D) {
      for (int r = 0; r < valid; ++r) z += to_float(kf[r * L::lde + threadIdx.x]);
    }
    accumulate_at_b<T, D>(acc, kf, vt, rows);
  }
  float* state = state_target(p.states, p.chunk_parts, p.shape, w, L::state);
  const bool atomic = chunks > 1 && p.chunk_parts == nullptr;
  write_state<T, D>(acc, state, atomic, staging);
  if (threadIdx.x < D) {
    if (atomic)
      atomicAdd(state + D * D + threadIdx.x, z);
    else
      state[D * D + threadIdx.x] = z;
  }
}

template <typename T, int D>
__host__ __device__ constexpr size_t output_smem() {
  using L = Layout<T, D>;
  using E = typename Mma<T>::elem;
  return align128(D * L::lde * sizeof(E)) + align128(kTile * L::lde * sizeof(E)) +
         align128(kTile * L::ldf * 4) + align128(D * 4) + align128(kTile * 4);
}

template <typename T, int D>
__global__ void __launch_bounds__(kThreads) output_kernel(BlockLinearForward p, int chunks) {
  using L = Layout<T, D>;
  using E = typename Mma<T>::elem;
  extern __shared__ __align__(128) unsigned char smem[];
  unsigned char* cursor = smem;
  auto take = [&](size_t bytes) {
    unsigned char* at = cursor;
    cursor += align128(bytes);
    return at;
  };
  E* s = reinterpret_cast<E*>(take(D * L::lde * sizeof(E)));
  E* qf = reinterpret_cast<E*>(take(kTile * L::lde * sizeof(E)));
  float* numerator = reinterpret_cast<float*>(take(kTile * L::ldf * 4));
  float* z = reinterpret_cast<float*>(take(D * 4));
  float* denominator = reinterpret_cast<float*>(take(kTile * 4));
  const Work w = work_of(p.shape, chunks);
  // The first tile's q rows are in flight with the state; each next tile's during this one's work.
  TileRows<T, D> q_rows;
  auto issue = [&](int n0) {
    const int valid = min(kTile, w.end - n0), rows = (valid + 15) / 16 * 16;
    q_rows.load(p.q, w.b, w.h, n0, valid, rows);
  };
  if (w.begin < w.end) issue(w.begin);
  load_state<T, D>(p.mixed + (static_cast<size_t>(w.bh) * p.shape.blocks + w.block) * L::state, s,
                   z);
  T* out = static_cast<T*>(p.out);
  const int lane = threadIdx.x % L::lanes;
  for (int n0 = w.begin; n0 < w.end; n0 += kTile) {
    const int valid = min(kTile, w.end - n0), rows = (valid + 15) / 16 * 16;
    __syncthreads();
    q_rows.store_features(valid, rows, qf, nullptr);
    if (n0 + kTile < w.end) issue(n0 + kTile);
    __syncthreads();
    for (int r = threadIdx.x; r < valid; r += kThreads) {
      float dot = 0.f;
      for (int d = 0; d < D; ++d) dot += to_float(qf[r * L::lde + d]) * z[d];
      denominator[r] = dot + kDenominatorEps;
    }
    multiply_tile<T, D, false>(qf, s, numerator, rows);
    __syncthreads();
    for (int r = threadIdx.x / L::lanes; r < valid; r += L::rows_per_pass) {
      float x[L::vec];
      const float inv = 1.f / denominator[r];
#pragma unroll
      for (int i = 0; i < L::vec; ++i) x[i] = numerator[r * L::ldf + lane * L::vec + i] * inv;
      const size_t row = (static_cast<size_t>(w.b) * p.shape.tokens + n0 + r) * p.shape.heads + w.h;
      store_vector<T, D>(out + row * D + lane * L::vec, x);
    }
  }
}

// S'_i = sum_j m_ij S_j over the state elements of one batch*head, 256 elements per CTA.
__global__ void __launch_bounds__(kThreads)
    mix_kernel(const float* states, const float* mixing, float* mixed, int blocks, int state) {
  extern __shared__ __align__(128) unsigned char smem[];
  float* m = reinterpret_cast<float*>(smem);
  float* x = m + blocks * blocks;
  const int e = blockIdx.x * kThreads + threadIdx.x;
  const size_t base = static_cast<size_t>(blockIdx.y) * blocks * state;
  for (int i = threadIdx.x; i < blocks * blocks; i += kThreads) m[i] = mixing[i];
  for (int j = 0; j < blocks; ++j)
    x[j * kThreads + threadIdx.x] =
        e < state ? states[base + static_cast<size_t>(j) * state + e] : 0.f;
  __syncthreads();
  if (e >= state) return;
  for (int i = 0; i < blocks; ++i) {
    float sum = 0.f;
    for (int j = 0; j < blocks; ++j) sum += m[i * blocks + j] * x[j * kThreads + threadIdx.x];
    mixed[base + static_cast<size_t>(i) * state + e] = sum;
  }
}

template <typename T, int D>
__host__ __device__ constexpr size_t query_backward_smem() {
  using L = Layout<T, D>;
  using E = typename Mma<T>::elem;
  return align128(D * L::lde * sizeof(E)) + 2 * align128(kTile * L::lde * sizeof(E)) +
         align128(kTile * L::ldf * 4) + align128(D * 4) + 3 * align128(kTile * 4) +
         kWarps * 256 * 4;
}

// dq and dS'_i, dz'_i for the tokens of one chunk of block i.
// Three CTAs per multiprocessor (85 registers; two at its natural 90).
template <typename T, int D>
__global__ void __launch_bounds__(kThreads, 3)
    query_backward_kernel(BlockLinearBackward p, int chunks) {
  using L = Layout<T, D>;
  using E = typename Mma<T>::elem;
  extern __shared__ __align__(128) unsigned char smem[];
  unsigned char* cursor = smem;
  auto take = [&](size_t bytes) {
    unsigned char* at = cursor;
    cursor += align128(bytes);
    return at;
  };
  E* s = reinterpret_cast<E*>(take(D * L::lde * sizeof(E)));
  E* qf = reinterpret_cast<E*>(take(kTile * L::lde * sizeof(E)));
  E* dnum = reinterpret_cast<E*>(take(kTile * L::lde * sizeof(E)));
  float* dphi = reinterpret_cast<float*>(take(kTile * L::ldf * 4));
  float* z = reinterpret_cast<float*>(take(D * 4));
  float* inv_rms = reinterpret_cast<float*>(take(kTile * 4));
  float* denominator = reinterpret_cast<float*>(take(kTile * 4));
  float* dden = reinterpret_cast<float*>(take(kTile * 4));
  float* staging = reinterpret_cast<float*>(cursor);
  const Work w = work_of(p.shape, chunks);
  const size_t state_offset = (static_cast<size_t>(w.bh) * p.shape.blocks + w.block) * L::state;
  // A tile's q, dO and o rows are loaded together (the first tile's with the state); q's raw
  // rows stay in registers for the feature backward at the end of the tile.
  TileRows<T, D> q_rows, go_rows, o_rows;
  auto issue = [&](int n0) {
    const int valid = min(kTile, w.end - n0), rows = (valid + 15) / 16 * 16;
    q_rows.load(p.q, w.b, w.h, n0, valid, rows);
    go_rows.load(p.grad_out, w.b, w.h, n0, valid, rows);
    o_rows.load(p.out, w.b, w.h, n0, valid, rows);
  };
  if (w.begin < w.end) issue(w.begin);
  load_state<T, D>(p.mixed + state_offset, s, z);

  FragC<T> acc[L::frags_per_warp];
#pragma unroll
  for (int u = 0; u < L::frags_per_warp; ++u) wmma::fill_fragment(acc[u], 0.f);
  float dz = 0.f;
  T* grad_q = static_cast<T*>(p.grad_q);
  const int lane = threadIdx.x % L::lanes;
  for (int n0 = w.begin; n0 < w.end; n0 += kTile) {
    const int valid = min(kTile, w.end - n0), rows = (valid + 15) / 16 * 16;
    if (n0 != w.begin) issue(n0);
    __syncthreads();
    q_rows.store_features(valid, rows, qf, inv_rms);
    __syncthreads();
    for (int r = threadIdx.x; r < valid; r += kThreads) {
      float dot = 0.f;
      for (int d = 0; d < D; ++d) dot += to_float(qf[r * L::lde + d]) * z[d];
      denominator[r] = dot + kDenominatorEps;
    }
    __syncthreads();
    // d(numerator) = dO / den; d(den) = -(dO . o) / den.
#pragma unroll
    for (int pass = 0; pass < TileRows<T, D>::passes; ++pass) {
      const int r = TileRows<T, D>::row(pass);
      if (r >= rows) break;
      float g[L::vec], o[L::vec];
      float dot = 0.f;
      if (r < valid) {
        go_rows.values(pass, g);
        o_rows.values(pass, o);
        const float inv = 1.f / denominator[r];
#pragma unroll
        for (int i = 0; i < L::vec; ++i) {
          dot += g[i] * o[i];
          g[i] *= inv;
        }
      } else {
#pragma unroll
        for (int i = 0; i < L::vec; ++i) g[i] = 0.f;
      }
      dot = row_sum<L::lanes>(dot);
#pragma unroll
      for (int i = 0; i < L::vec; ++i) dnum[r * L::lde + lane * L::vec + i] = from_float<E>(g[i]);
      if (lane == 0) dden[r] = r < valid ? -dot / denominator[r] : 0.f;
    }
    __syncthreads();
    if (threadIdx.x < D) {
      for (int r = 0; r < valid; ++r) dz += to_float(qf[r * L::lde + threadIdx.x]) * dden[r];
    }
    accumulate_at_b<T, D>(acc, qf, dnum, rows);
    multiply_tile<T, D, true>(dnum, s, dphi, rows);  // d(phi(q)) = dnum S'^T (+ dden z' below)
    __syncthreads();
    // Whole warps run the row loop (feature_backward shuffles across a row's lanes); rows past
    // `valid` compute on zeros and store nothing.
#pragma unroll
    for (int pass = 0; pass < TileRows<T, D>::passes; ++pass) {
      const int r = TileRows<T, D>::row(pass);
      if (r >= rows) break;
      float x[L::vec], g[L::vec];
      const bool live = r < valid;
      q_rows.values(pass, x);
#pragma unroll
      for (int i = 0; i < L::vec; ++i) {
        const int d = lane * L::vec + i;
        if (!live) x[i] = 0.f;
        g[i] = live ? dphi[r * L::ldf + d] + dden[r] * z[d] : 0.f;
      }
      feature_backward<T, D>(x, live ? inv_rms[r] : 0.f, g);
      const size_t row = (static_cast<size_t>(w.b) * p.shape.tokens + n0 + r) * p.shape.heads + w.h;
      if (live) store_vector<T, D>(grad_q + row * D + lane * L::vec, g);
    }
  }
  float* grad_state = state_target(p.grad_mixed, p.chunk_parts, p.shape, w, L::state);
  const bool atomic = chunks > 1 && p.chunk_parts == nullptr;
  write_state<T, D>(acc, grad_state, atomic, staging);
  if (threadIdx.x < D) {
    if (atomic)
      atomicAdd(grad_state + D * D + threadIdx.x, dz);
    else
      grad_state[D * D + threadIdx.x] = dz;
  }
}

// dS_j = sum_i m_ij dS'_i and dm_ij = sum over batch, heads and elements of dS'_i * S_j.
// Persistent CTAs walk (batch*head, 64-element column) items; each thread keeps its (i, j) pairs
// of dm in registers and adds them to the result once.
__global__ void __launch_bounds__(kThreads)
    mix_backward_kernel(const float* grad_mixed, const float* states, const float* mixing,
                        float* grad_states, float* grad_mixing, int batch_heads, int blocks,
                        int state) {
  constexpr int kPairs = 4096 / kThreads;  // blocks <= 64
  constexpr int ld = kMixColumns + 1;
  extern __shared__ __align__(128) unsigned char smem[];
  float* m = reinterpret_cast<float*>(smem);
  float* x = m + blocks * blocks;
  float* y = x + blocks * ld;
  for (int i = threadIdx.x; i < blocks * blocks; i += kThreads) m[i] = mixing[i];
  float pair_sum[kPairs];
#pragma unroll
  for (int u = 0; u < kPairs; ++u) pair_sum[u] = 0.f;
  const int columns = (state + kMixColumns - 1) / kMixColumns;
  for (int item = blockIdx.x; item < batch_heads * columns; item += gridDim.x) {
    const size_t base = static_cast<size_t>(item / columns) * blocks * state;
    const int e0 = (item % columns) * kMixColumns;
    __syncthreads();
    for (int idx = threadIdx.x; idx < blocks * kMixColumns; idx += kThreads) {
      const int j = idx / kMixColumns, c = idx % kMixColumns, e = e0 + c;
      const size_t at = base + static_cast<size_t>(j) * state + e;
      x[j * ld + c] = e < state ? grad_mixed[at] : 0.f;
      y[j * ld + c] = e < state ? states[at] : 0.f;
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < blocks * kMixColumns; idx += kThreads) {
      const int j = idx / kMixColumns, c = idx % kMixColumns, e = e0 + c;
      if (e >= state) continue;
      float sum = 0.f;
      for (int i = 0; i < blocks; ++i) sum += m[i * blocks + j] * x[i * ld + c];
      grad_states[base + static_cast<size_t>(j) * state + e] = sum;
    }
#pragma unroll
    for (int u = 0; u < kPairs; ++u) {
      const int pair = threadIdx.x + u * kThreads;
      if (pair < blocks * blocks) {
        const int i = pair / blocks, j = pair % blocks;
        float sum = 0.f;
        for (int c = 0; c < kMixColumns; ++c) sum += x[i * ld + c] * y[j * ld + c];
        pair_sum[u] += sum;
      }
    }
  }
#pragma unroll
  for (int u = 0; u < kPairs; ++u) {
    const int pair = threadIdx.x + u * kThreads;
    if (pair < blocks * blocks) atomicAdd(grad_mixing + pair, pair_sum[u]);
  }
}

template <typename T, int D>
__host__ __device__ constexpr size_t key_backward_smem() {
  using L = Layout<T, D>;
  using E = typename Mma<T>::elem;
  return align128(D * L::lde * sizeof(E)) + 2 * align128(kTile * L::lde * sizeof(E)) +
         2 * align128(kTile * L::ldf * 4) + align128(D * 4) + align128(kTile * 4);
}

// dk and dv for the tokens of one chunk of block j, from dS_j and dz_j.
template <typename T, int D>
__global__ void __launch_bounds__(kThreads) key_backward_kernel(BlockLinearBackward p, int chunks) {
  using L = Layout<T, D>;
  using E = typename Mma<T>::elem;
  extern __shared__ __align__(128) unsigned char smem[];
  unsigned char* cursor = smem;
  auto take = [&](size_t bytes) {
    unsigned char* at = cursor;
    cursor += align128(bytes);
    return at;
  };
  E* ds = reinterpret_cast<E*>(take(D * L::lde * sizeof(E)));
  E* kf = reinterpret_cast<E*>(take(kTile * L::lde * sizeof(E)));
  E* vt = reinterpret_cast<E*>(take(kTile * L::lde * sizeof(E)));
  float* dphi = reinterpret_cast<float*>(take(kTile * L::ldf * 4));
  float* dv = reinterpret_cast<float*>(take(kTile * L::ldf * 4));
  float* dz = reinterpret_cast<float*>(take(D * 4));
  float* inv_rms = reinterpret_cast<float*>(take(kTile * 4));
  const Work w = work_of(p.shape, chunks);
  // A tile's k and v rows are loaded together (the first tile's with dS); k's raw rows stay in
  // registers for the feature backward.
  TileRows<T, D> k_rows, v_rows;
  auto issue = [&](int n0) {
    const int valid = min(kTile, w.end - n0), rows = (valid + 15) / 16 * 16;
    k_rows.load(p.k, w.b, w.h, n0, valid, rows);
    v_rows.load(p.v, w.b, w.h, n0, valid, rows);
  };
  if (w.begin < w.end) issue(w.begin);
  load_state<T, D>(
      p.grad_states + (static_cast<size_t>(w.bh) * p.shape.blocks + w.block) * L::state, ds, dz);
  T* grad_k = static_cast<T*>(p.grad_k);
  T* grad_v = static_cast<T*>(p.grad_v);
  const int lane = threadIdx.x % L::lanes;
  for (int n0 = w.begin; n0 < w.end; n0 += kTile) {
    const int valid = min(kTile, w.end - n0), rows = (valid + 15) / 16 * 16;
    if (n0 != w.begin) issue(n0);
    __syncthreads();
    k_rows.store_features(valid, rows, kf, inv_rms);
    v_rows.store_plain(rows, vt);
    __syncthreads();
    multiply_tile<T, D, true>(vt, ds, dphi, rows);  // d(phi(k)) = V dS^T (+ dz below)
    multiply_tile<T, D, false>(kf, ds, dv, rows);   // dV = phi(K) dS
    __syncthreads();
#pragma unroll
    for (int pass = 0; pass < TileRows<T, D>::passes; ++pass) {  // whole warps, as above
      const int r = TileRows<T, D>::row(pass);
      if (r >= rows) break;
      float x[L::vec], g[L::vec];
      const bool live = r < valid;
      const size_t row = (static_cast<size_t>(w.b) * p.shape.tokens + n0 + r) * p.shape.heads + w.h;
      k_rows.values(pass, x);
      if (live) {
#pragma unroll
        for (int i = 0; i < L::vec; ++i) g[i] = dv[r * L::ldf + lane * L::vec + i];
        store_vector<T, D>(grad_v + row * D + lane * L::vec, g);
      }
#pragma unroll
      for (int i = 0; i < L::vec; ++i) {
        const int d = lane * L::vec + i;
        if (!live) x[i] = 0.f;
        g[i] = live ? dphi[r * L::ldf + d] + dz[d] : 0.f;
      }
      feature_backward<T, D>(x, live ? inv_rms[r] : 0.f, g);
      if (live) store_vector<T, D>(grad_k + row * D + lane * L::vec, g);
    }
  }
}

}  // namespace

namespace {

// Which passes run on mma.sync fragments (block_fragment_passes.h) where they take the dtype
// and head dimension: all four by default; MHLA_FRAGMENT_PASSES=0 keeps the WMMA kernels below,
// a comma list (states,output,query,key) names the fragment ones, for A/B runs in one binary.
bool fragment_pass(const char* name) {
  static const std::string chosen = [] {
    const char* value = std::getenv("MHLA_FRAGMENT_PASSES");
    return std::string(value != nullptr ? value : "states,output,query,key");
  }();
  return chosen.find(name) != std::string::npos;
}

// MHLA_SCALAR_STATE_ADDS=1: the fragment passes add shared states one element per atomic (A/B).
bool scalar_state_adds() {
  static const bool chosen = [] {
    const char* value = std::getenv("MHLA_SCALAR_STATE_ADDS");
    return value != nullptr && std::string(value) == "1";
  }();
  return chosen;
}

// MHLA_PACKED_STATE_STORES=direct: the states and query passes store packed states straight
// from the accumulators instead of through shared memory (A/B).
bool direct_packed_stores() {
  static const bool chosen = [] {
    const char* value = std::getenv("MHLA_PACKED_STATE_STORES");
    return value != nullptr && std::string(value) == "direct";
  }();
  return chosen;
}

// The arguments with the state-writing switches above applied.
template <typename Args>
Args with_state_writes(const Args& a) {
  Args b = a;
  b.scalar_state_adds = a.scalar_state_adds || scalar_state_adds();
  b.direct_packed_stores = a.direct_packed_stores || direct_packed_stores();
  return b;
}

}  // namespace

bool fragment_passes_in_use(DType dtype, int head_dim) {
  return fragment_passes_supported(dtype, head_dim) && fragment_pass("states") &&
         fragment_pass("output") && fragment_pass("query") && fragment_pass("key");
}

namespace {

int chunks_per_block(const BlockLinearShape& s) {
  const int length = s.tokens / s.blocks;
  return (length + kChunk - 1) / kChunk;
}

// Packed state sets are read (and, by the states and query passes, written) by the fragment
// passes of bf16 inputs only.
template <typename T>
bool reads_packed(DType dtype, int head_dim, const char* pass) {
  return std::is_same_v<T, __nv_bfloat16> && fragment_pass(pass) &&
         fragment_passes_supported(dtype, head_dim);
}

// Ordered sums (BlockLinearForward::chunk_parts): the chunks' parts summed in chunk order into
// `set`, by the column-sum kernel over the parts as a [chunks, state floats] matrix.
cudaError_t sum_chunk_parts(const BlockLinearShape& s, int chunks, float* parts, float* set,
                            cudaStream_t stream) {
  if (block_linear_state_floats(s) > 0x7fffffff) return cudaErrorInvalidValue;  // int columns
  ColumnSumArgs sum;
  sum.dtype = DType::f32;
  sum.rows = chunks;
  sum.cols = static_cast<int>(block_linear_state_floats(s));
  sum.x = parts;
  sum.out = set;
  sum.workspace = parts + static_cast<size_t>(chunks) * block_linear_state_floats(s);
  return column_sum(sum, stream);
}

template <typename T, int D>
cudaError_t forward_for(const BlockLinearForward& a, cudaStream_t stream) {
  const auto& s = a.shape;
  if (a.packed_mixed && (!reads_packed<T>(a.dtype, D, "output") ||
                         ((a.passes & kBlockMixPass) && a.mixing != nullptr)))
    return cudaErrorInvalidValue;
  const int chunks = chunks_per_block(s);
  if (a.packed_states && (!reads_packed<T>(a.dtype, D, "states") || chunks > 1 ||
                          (a.passes & (kBlockMixPass | kBlockOutputPass))))
    return cudaErrorInvalidValue;
  const dim3 grid(s.blocks * chunks, s.batch * s.heads);
  const size_t state_bytes = block_linear_state_floats(s) * sizeof(float);
  cudaError_t err = cudaSuccess;
  if (a.passes & kBlockStatesPass) {
    const bool ordered = chunks > 1 && a.chunk_parts != nullptr;
    if (chunks > 1 && !ordered &&
        (err = cudaMemsetAsync(a.states, 0, state_bytes, stream)) != cudaSuccess)
      return err;
    if (fragment_pass("states") && fragment_passes_supported(a.dtype, D)) {
      if ((err = fragment_states(with_state_writes(a), chunks, stream)) != cudaSuccess) return err;
    } else {
      constexpr size_t states_bytes = states_smem<T, D>();
      if ((err = allow_smem(states_kernel<T, D>, states_bytes)) != cudaSuccess) return err;
      states_kernel<T, D><<<grid, kThreads, states_bytes, stream>>>(a, chunks);
    }
    if (ordered &&
        (err = sum_chunk_parts(s, chunks, a.chunk_parts, a.states, stream)) != cudaSuccess)
      return err;
  }
  if (a.passes & kBlockMixPass) {
    if (a.mixing != nullptr) {
      const int state = Layout<T, D>::state;
      const size_t mix_bytes =
          (static_cast<size_t>(s.blocks) * s.blocks + static_cast<size_t>(s.blocks) * kThreads) * 4;
      if ((err = allow_smem(mix_kernel, mix_bytes)) != cudaSuccess) return err;
      mix_kernel<<<dim3((state + kThreads - 1) / kThreads, s.batch * s.heads), kThreads, mix_bytes,
                   stream>>>(a.states, a.mixing, a.mixed, s.blocks, state);
    } else if (a.mixed != a.states) {
      if ((err = cudaMemcpyAsync(a.mixed, a.states, state_bytes, cudaMemcpyDeviceToDevice,
                                 stream)) != cudaSuccess)
        return err;
    }
  }
  if (a.passes & kBlockOutputPass) {
    if (fragment_pass("output") && fragment_passes_supported(a.dtype, D)) {
      if ((err = fragment_output(a, chunks, stream)) != cudaSuccess) return err;
    } else {
      constexpr size_t output_bytes = output_smem<T, D>();
      if ((err = allow_smem(output_kernel<T, D>, output_bytes)) != cudaSuccess) return err;
      output_kernel<T, D><<<grid, kThreads, output_bytes, stream>>>(a, chunks);
    }
  }
  return cudaGetLastError();
}

template <typename T, int D>
cudaError_t backward_for(const BlockLinearBackward& a, cudaStream_t stream) {
  const auto& s = a.shape;
  if ((a.packed_mixed && !reads_packed<T>(a.dtype, D, "query")) ||
      (a.packed_grad_states && (!reads_packed<T>(a.dtype, D, "key") ||
                                ((a.passes & kBlockMixPass) && a.mixing != nullptr))))
    return cudaErrorInvalidValue;
  const int chunks = chunks_per_block(s);
  if (a.packed_grad_mixed &&
      (!reads_packed<T>(a.dtype, D, "query") || chunks > 1 || (a.passes & kBlockMixPass)))
    return cudaErrorInvalidValue;
  const dim3 grid(s.blocks * chunks, s.batch * s.heads);
  const size_t state_bytes = block_linear_state_floats(s) * sizeof(float);
  cudaError_t err = cudaSuccess;
  const bool ordered = chunks > 1 && a.chunk_parts != nullptr;
  if (a.passes & kBlockQueryPass) {
    if (chunks > 1 && !ordered &&
        (err = cudaMemsetAsync(a.grad_mixed, 0, state_bytes, stream)) != cudaSuccess)
      return err;
    if (fragment_pass("query") && fragment_passes_supported(a.dtype, D)) {
      if ((err = fragment_query_backward(with_state_writes(a), chunks, stream)) != cudaSuccess)
        return err;
    } else {
      if (a.zero_on_entry != nullptr &&
          (err = cudaMemsetAsync(a.zero_on_entry, 0, sizeof(float) * a.zero_floats, stream)) !=
              cudaSuccess)
        return err;  // the fragment passes zero it themselves
      constexpr size_t query_bytes = query_backward_smem<T, D>();
      if ((err = allow_smem(query_backward_kernel<T, D>, query_bytes)) != cudaSuccess) return err;
      query_backward_kernel<T, D><<<grid, kThreads, query_bytes, stream>>>(a, chunks);
    }
    if (ordered &&
        (err = sum_chunk_parts(s, chunks, a.chunk_parts, a.grad_mixed, stream)) != cudaSuccess)
      return err;
  }
  if (a.passes & kBlockMixPass) {
    if (a.mixing != nullptr) {
      const int state = Layout<T, D>::state;
      if ((err = cudaMemsetAsync(a.grad_mixing, 0, sizeof(float) * s.blocks * s.blocks, stream)) !=
          cudaSuccess)
        return err;
      const size_t mix_bytes = (static_cast<size_t>(s.blocks) * s.blocks +
                                2 * static_cast<size_t>(s.blocks) * (kMixColumns + 1)) *
                               4;
      if ((err = allow_smem(mix_backward_kernel, mix_bytes)) != cudaSuccess) return err;
      const int items = s.batch * s.heads * ((state + kMixColumns - 1) / kMixColumns);
      const int ctas = items < 2 * multiprocessors() ? items : 2 * multiprocessors();
      mix_backward_kernel<<<ctas, kThreads, mix_bytes, stream>>>(
          a.grad_mixed, a.states, a.mixing, a.grad_states, a.grad_mixing, s.batch * s.heads,
          s.blocks, state);
    } else if (a.grad_states != a.grad_mixed) {
      if ((err = cudaMemcpyAsync(a.grad_states, a.grad_mixed, state_bytes, cudaMemcpyDeviceToDevice,
                                 stream)) != cudaSuccess)
        return err;
    }
  }
  if (a.passes & kBlockKeyPass) {
    if (fragment_pass("key") && fragment_passes_supported(a.dtype, D)) {
      if ((err = fragment_key_backward(a, chunks, stream)) != cudaSuccess) return err;
    } else {
      constexpr size_t key_bytes = key_backward_smem<T, D>();
      if ((err = allow_smem(key_backward_kernel<T, D>, key_bytes)) != cudaSuccess) return err;
      key_backward_kernel<T, D><<<grid, kThreads, key_bytes, stream>>>(a, chunks);
    }
  }
  return cudaGetLastError();
}

bool supported(const BlockLinearShape& s, bool has_mixing) {
  const bool dim_ok = s.head_dim == 32 || s.head_dim == 64 || s.head_dim == 128;
  return dim_ok && s.batch > 0 && s.heads > 0 && s.tokens > 0 && s.blocks >= 1 && s.blocks <= 64 &&
         s.tokens % s.blocks == 0 && static_cast<int64_t>(s.batch) * s.heads <= 65535 &&
         static_cast<int64_t>(s.blocks) * ((s.tokens / s.blocks + kChunk - 1) / kChunk) <=
             0x7fffffff &&
         (has_mixing || s.blocks == 1);
}

template <typename T, int D>
struct ForwardPass {
  static cudaError_t run(const BlockLinearForward& a, cudaStream_t s) {
    return forward_for<T, D>(a, s);
  }
};
template <typename T, int D>
struct BackwardPass {
  static cudaError_t run(const BlockLinearBackward& a, cudaStream_t s) {
    return backward_for<T, D>(a, s);
  }
};

}  // namespace

size_t block_linear_state_floats(const BlockLinearShape& s) {
  return static_cast<size_t>(s.batch) * s.heads * s.blocks *
         (static_cast<size_t>(s.head_dim) * s.head_dim + s.head_dim);
}

size_t block_linear_chunk_parts_floats(const BlockLinearShape& s) {
  const int chunks = s.blocks >= 1 ? chunks_per_block(s) : 1;
  if (chunks <= 1) return 0;
  const size_t floats = block_linear_state_floats(s);
  return chunks * floats + column_sum_workspace_floats(chunks, static_cast<int>(floats));
}

bool block_states_packable(const BlockLinearShape& s, DType dtype) {
  return dtype == DType::bf16 && fragment_pass("states") && fragment_pass("query") &&
         fragment_passes_supported(dtype, s.head_dim) && s.blocks >= 1 && chunks_per_block(s) == 1;
}

bool block_states_shared_by_chunks(const BlockLinearShape& s) {
  return s.blocks >= 1 && chunks_per_block(s) > 1;
}

size_t block_linear_packed_floats(const BlockLinearShape& s) {
  return static_cast<size_t>(s.batch) * s.heads * s.blocks *
         (static_cast<size_t>(s.head_dim) * s.head_dim / 2 + s.head_dim);
}

cudaError_t block_linear_forward(const BlockLinearForward& args, cudaStream_t stream) {
  if (!supported(args.shape, args.mixing != nullptr)) return cudaErrorInvalidValue;
  auto run = launcher_for<BlockLinearForward, ForwardPass>(args.dtype, args.shape.head_dim);
  return run != nullptr ? run(args, stream) : cudaErrorInvalidValue;
}

cudaError_t block_linear_backward(const BlockLinearBackward& args, cudaStream_t stream) {
  if (!supported(args.shape, args.mixing != nullptr)) return cudaErrorInvalidValue;
  auto run = launcher_for<BlockLinearBackward, BackwardPass>(args.dtype, args.shape.head_dim);
  return run != nullptr ? run(args, stream) : cudaErrorInvalidValue;
}

}  // namespace mhla_kernels
