// Dense masked block linear attention: see dense_block_linear.h for the math. Three kernels,
// 256 threads each, one 64-token tile of queries or keys per CTA, looping over the other side's
// tiles; every product is a 64 x 64 x D (or 64 x D x 64) tensor-core product from shared memory.
#include "mhla/dense_block_linear.h"
#include "mhla/tiles.cuh"

namespace mhla_kernels {
namespace {

using namespace tiles;

constexpr int kSquareF = kTile + 4;  // leading dimension of fp32 64 x 64 score tiles
constexpr int kSquareE = kTile + 8;  // leading dimension of 64 x 64 tiles of tensor-core elements
constexpr size_t kMaxSmem = 227 * 1024;

// Shared-memory sizes of the three kernels (bytes), for a dtype and head dimension.
template <typename T, int D>
struct DenseSmem {
  using L = Layout<T, D>;
  using E = typename Mma<T>::elem;
  static constexpr size_t token_tile = align128(kTile * L::lde * sizeof(E));
  static constexpr size_t score_f32 = align128(kTile * kSquareF * 4);
  static constexpr size_t score_elem = align128(kTile * kSquareE * sizeof(E));
  static constexpr size_t rows_f32 = align128(kTile * L::ldf * 4);
  static constexpr size_t vector = align128(kTile * 4);
  static constexpr size_t forward = 3 * token_tile + score_f32 + score_elem + rows_f32 + vector;
  static size_t keys(int blocks) {
    return 4 * token_tile + 2 * score_f32 + 2 * score_elem + 2 * rows_f32 + 2 * vector +
           align128(static_cast<size_t>(blocks) * blocks * 4);
  }
  static constexpr size_t queries = 4 * token_tile + score_f32 + score_elem + rows_f32 + 2 * vector;
};

// out[r][c] (fp32, 64 x 64, ld kSquareF) = sum_k a[r][k] b[c][k] for token tiles a, b [64][D].
template <typename T, int D>
__device__ void square_product(const typename Mma<T>::elem* a, const typename Mma<T>::elem* b,
                               float* out) {
  using L = Layout<T, D>;
  const int warp = threadIdx.x / 32;
  for (int f = warp; f < 16; f += kWarps) {
    const int fm = f / 4, fn = f % 4;
    FragC<T> acc;
    wmma::fill_fragment(acc, 0.f);
    for (int kk = 0; kk < D; kk += Mma<T>::k) {
      FragA<T, wmma::row_major> fa;
      FragB<T, wmma::col_major> fb;
      load_fragment<T>(fa, a + fm * 16 * L::lde + kk, L::lde);
      load_fragment<T>(fb, b + fn * 16 * L::lde + kk, L::lde);
      wmma::mma_sync(acc, fa, fb, acc);
    }
    wmma::store_matrix_sync(out + fm * 16 * kSquareF + fn * 16, acc, kSquareF,
                            wmma::mem_row_major);
  }
}

// Accumulators of a 64 x D result, spread over the warps.
template <typename T, int D>
struct RowsAcc {
  static constexpr int frags = 4 * (D / 16);
  static constexpr int per_warp = (frags + kWarps - 1) / kWarps;
  FragC<T> f[per_warp];
  __device__ void zero() {
#pragma unroll
    for (int u = 0; u < per_warp; ++u) wmma::fill_fragment(f[u], 0.f);
  }
  // += s (64 x 64 elements, ld kSquareE) x t (token tile [64][D]).
  __device__ void add_product(const typename Mma<T>::elem* s, const typename Mma<T>::elem* t) {
    using L = Layout<T, D>;
    const int warp = threadIdx.x / 32;
    for (int kk = 0; kk < kTile; kk += Mma<T>::k) {
#pragma unroll
      for (int u = 0; u < per_warp; ++u) {
        const int g = warp + u * kWarps;
        if (g < frags) {
          const int fm = g / (D / 16), fn = g % (D / 16);
          FragA<T, wmma::row_major> fa;
          FragB<T, wmma::row_major> fb;
          load_fragment<T>(fa, s + fm * 16 * kSquareE + kk, kSquareE);
          load_fragment<T>(fb, t + kk * L::lde + fn * 16, L::lde);
          wmma::mma_sync(f[u], fa, fb, f[u]);
        }
      }
    }
  }
  // Into an fp32 tile [64][ldf].
  __device__ void store(float* out) {
    using L = Layout<T, D>;
    const int warp = threadIdx.x / 32;
#pragma unroll
    for (int u = 0; u < per_warp; ++u) {
      const int g = warp + u * kWarps;
      if (g < frags) {
        const int fm = g / (D / 16), fn = g % (D / 16);
        wmma::store_matrix_sync(out + fm * 16 * L::ldf + fn * 16, f[u], L::ldf,
                                wmma::mem_row_major);
      }
    }
  }
};

// w(t, s) for query token t and key token s (both < N).
__device__ __forceinline__ float mixing_weight(const float* mixing, int blocks, int length,
                                               bool causal, int t, int s) {
  if (causal && s > t) return 0.f;
  return mixing == nullptr ? 1.f : __ldg(mixing + (t / length) * blocks + s / length);
}

// Tokens per block: N / M, or 64 in causal mode.
__device__ __forceinline__ int block_length(const BlockLinearShape& s, bool causal) {
  return causal ? kDenseCausalBlock : s.tokens / s.blocks;
}

// One 64-token tile of a (batch, head) pair: phi of one tensor (q or k) and another tensor as it
// is (v or g), rows past the sequence zero-filled.
template <typename T, int D>
__device__ void load_tile(const TokenTensor& featured, const TokenTensor& plain, int b, int h,
                          int n0, int valid, typename Mma<T>::elem* features,
                          typename Mma<T>::elem* values, float* inv_rms) {
  load_features<T, D>(featured, b, h, n0, valid, kTile, features, inv_rms);
  load_plain<T, D>(plain, b, h, n0, valid, kTile, values);
}

template <typename T, int D>
__global__ void __launch_bounds__(kThreads) dense_forward_kernel(DenseBlockLinearForward p) {
  using L = Layout<T, D>;
  using E = typename Mma<T>::elem;
  using S = DenseSmem<T, D>;
  extern __shared__ __align__(128) unsigned char smem[];
  Carver carve{smem};
  E* qf = carve.take<E>(S::token_tile);
  E* kf = carve.take<E>(S::token_tile);
  E* vt = carve.take<E>(S::token_tile);
  float* scores = carve.take<float>(S::score_f32);
  E* weighted = carve.take<E>(S::score_elem);
  float* rows = carve.take<float>(S::rows_f32);
  float* den = carve.take<float>(S::vector);

  const auto& s = p.shape;
  const int n = s.tokens, length = block_length(s, p.causal);
  const int bh = blockIdx.y, b = bh / s.heads, h = bh % s.heads;
  const int q0 = blockIdx.x * kTile, q_valid = min(kTile, n - q0);
  const int k_end = p.causal ? min(n, q0 + kTile) : n;  // causal: no tile above the diagonal
  load_features<T, D>(p.q, b, h, q0, q_valid, kTile, qf, nullptr);
  if (threadIdx.x < kTile) den[threadIdx.x] = 0.f;
  RowsAcc<T, D> out;
  out.zero();

  // Each thread weights a quarter row of the scores: row r, columns c0 .. c0 + 15.
  const int r = threadIdx.x / 4, c0 = (threadIdx.x % 4) * 16, t = q0 + r;
  for (int k0 = 0; k0 < k_end; k0 += kTile) {
    const int k_valid = min(kTile, n - k0);
    __syncthreads();
    load_tile<T, D>(p.k, p.v, b, h, k0, k_valid, kf, vt, nullptr);
    __syncthreads();
    square_product<T, D>(qf, kf, scores);
    __syncthreads();
    float sum = 0.f;
#pragma unroll 4
    for (int c = c0; c < c0 + 16; ++c) {
      const int key = k0 + c;
      const float w =
          (t < n && key < n) ? mixing_weight(p.mixing, s.blocks, length, p.causal, t, key) : 0.f;
      const float value = scores[r * kSquareF + c] * w;
      sum += value;
      weighted[r * kSquareE + c] = from_float<E>(value);
    }
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    if (threadIdx.x % 4 == 0) den[r] += sum;
    __syncthreads();
    out.add_product(weighted, vt);
  }
  __syncthreads();
  out.store(rows);
  __syncthreads();
  T* o = static_cast<T*>(p.out);
  const int lane = threadIdx.x % L::lanes;
  for (int row = threadIdx.x / L::lanes; row < q_valid; row += L::rows_per_pass) {
    float x[L::vec];
    const float scale = 1.f / (den[row] + kDenominatorEps);
#pragma unroll
    for (int i = 0; i < L::vec; ++i) x[i] = rows[row * L::ldf + lane * L::vec + i] * scale;
    const size_t index = (static_cast<size_t>(b) * n + q0 + row) * s.heads + h;
    store_vector<T, D>(o + index * D + lane * L::vec, x);
    if (lane == 0) p.den[static_cast<size_t>(bh) * n + q0 + row] = den[row];
  }
}

// dk, dv of one key tile and this tile's share of dm.
template <typename T, int D>
__global__ void __launch_bounds__(kThreads) dense_keys_kernel(DenseBlockLinearBackward p) {
  using L = Layout<T, D>;
  using E = typename Mma<T>::elem;
  using S = DenseSmem<T, D>;
  extern __shared__ __align__(128) unsigned char smem[];
  Carver carve{smem};
  E* kf = carve.take<E>(S::token_tile);
  E* vt = carve.take<E>(S::token_tile);
  E* qf = carve.take<E>(S::token_tile);
  E* gt = carve.take<E>(S::token_tile);
  float* scores_t = carve.take<float>(S::score_f32);  // [s][t] = phi(k_s) . phi(q_t)
  float* dp_t = carve.take<float>(S::score_f32);      // [s][t] = v_s . g_t
  E* p_t = carve.take<E>(S::score_elem);
  E* da_t = carve.take<E>(S::score_elem);
  float* dv_rows = carve.take<float>(S::rows_f32);
  float* dk_rows = carve.take<float>(S::rows_f32);
  float* gd = carve.take<float>(S::vector);
  float* inv_rms = carve.take<float>(S::vector);
  const bool mixes = p.mixing != nullptr;
  float* dm = mixes ? carve.take<float>(static_cast<size_t>(p.shape.blocks) * p.shape.blocks * 4)
                    : nullptr;

  const auto& s = p.shape;
  const int n = s.tokens, length = block_length(s, p.causal), blocks = s.blocks;
  const int bh = blockIdx.y, b = bh / s.heads, h = bh % s.heads;
  const int k0 = blockIdx.x * kTile, k_valid = min(kTile, n - k0);
  const int q_begin = p.causal ? k0 : 0;  // causal: queries before this tile never see it
  load_tile<T, D>(p.k, p.v, b, h, k0, k_valid, kf, vt, inv_rms);
  if (mixes) {
    for (int e = threadIdx.x; e < blocks * blocks; e += kThreads) dm[e] = 0.f;
  }
  RowsAcc<T, D> dv, dk;
  dv.zero();
  dk.zero();

  const int r = threadIdx.x / 4, c0 = (threadIdx.x % 4) * 16, key = k0 + r;
  for (int q0 = q_begin; q0 < n; q0 += kTile) {
    const int q_valid = min(kTile, n - q0);
    __syncthreads();
    load_tile<T, D>(p.q, p.grad_scaled, b, h, q0, q_valid, qf, gt, nullptr);
    if (threadIdx.x < kTile) {
      gd[threadIdx.x] =
          threadIdx.x < q_valid ? p.grad_den[static_cast<size_t>(bh) * n + q0 + threadIdx.x] : 0.f;
    }
    __syncthreads();
    square_product<T, D>(kf, qf, scores_t);
    square_product<T, D>(vt, gt, dp_t);
    __syncthreads();
    float dm_sum = 0.f;
    int dm_block = -1;
    for (int c = c0; c < c0 + 16; ++c) {
      const int t = q0 + c;
      const bool live = key < n && t < n;
      const float w = live ? mixing_weight(p.mixing, blocks, length, p.causal, t, key) : 0.f;
      const float a = scores_t[r * kSquareF + c];
      const float dp = dp_t[r * kSquareF + c] + gd[c];
      p_t[r * kSquareE + c] = from_float<E>(a * w);
      da_t[r * kSquareE + c] = from_float<E>(dp * w);
      if (mixes && live && !(p.causal && key > t)) {
        const int qb = t / length;
        if (qb != dm_block) {
          if (dm_block >= 0) atomicAdd(dm + dm_block * blocks + key / length, dm_sum);
          dm_block = qb;
          dm_sum = 0.f;
        }
        dm_sum += dp * a;
      }
    }
    if (dm_block >= 0) atomicAdd(dm + dm_block * blocks + key / length, dm_sum);
    __syncthreads();
    dv.add_product(p_t, gt);  // dv_s += sum_t P_ts g_t
    dk.add_product(da_t, qf); // dphi(k_s) += sum_t dA_ts phi(q_t)
  }
  __syncthreads();
  dv.store(dv_rows);
  dk.store(dk_rows);
  __syncthreads();
  T* grad_k = static_cast<T*>(p.grad_k);
  T* grad_v = static_cast<T*>(p.grad_v);
  const int lane = threadIdx.x % L::lanes;
  for (int row = threadIdx.x / L::lanes; row < kTile; row += L::rows_per_pass) {  // whole warps
    float x[L::vec], g[L::vec];
    const bool live = row < k_valid;
    const size_t index = (static_cast<size_t>(b) * n + k0 + row) * s.heads + h;
    if (live) {
#pragma unroll
      for (int i = 0; i < L::vec; ++i) g[i] = dv_rows[row * L::ldf + lane * L::vec + i];
      store_vector<T, D>(grad_v + index * D + lane * L::vec, g);
      load_vector<T, D>(token_row<T, D>(p.k, b, k0 + row, h) + lane * L::vec, x);
    }
#pragma unroll
    for (int i = 0; i < L::vec; ++i) {
      if (!live) x[i] = 0.f;
      g[i] = live ? dk_rows[row * L::ldf + lane * L::vec + i] : 0.f;
    }
    feature_backward<T, D>(x, live ? inv_rms[row] : 0.f, g);
    if (live) store_vector<T, D>(grad_k + index * D + lane * L::vec, g);
  }
  if (mixes) {
    __syncthreads();
    for (int e = threadIdx.x; e < blocks * blocks; e += kThreads) {
      if (dm[e] != 0.f) atomicAdd(p.grad_mixing + e, dm[e]);
    }
  }
}

// dq of one query tile.
template <typename T, int D>
__global__ void __launch_bounds__(kThreads) dense_queries_kernel(DenseBlockLinearBackward p) {
  using L = Layout<T, D>;
  using E = typename Mma<T>::elem;
  using S = DenseSmem<T, D>;
  extern __shared__ __align__(128) unsigned char smem[];
  Carver carve{smem};
  E* qf = carve.take<E>(S::token_tile);
  E* gt = carve.take<E>(S::token_tile);
  E* kf = carve.take<E>(S::token_tile);
  E* vt = carve.take<E>(S::token_tile);
  float* dp = carve.take<float>(S::score_f32);  // [t][s] = g_t . v_s
  E* da = carve.take<E>(S::score_elem);
  float* dq_rows = carve.take<float>(S::rows_f32);
  float* gd = carve.take<float>(S::vector);
  float* inv_rms = carve.take<float>(S::vector);

  const auto& s = p.shape;
  const int n = s.tokens, length = block_length(s, p.causal);
  const int bh = blockIdx.y, b = bh / s.heads, h = bh % s.heads;
  const int q0 = blockIdx.x * kTile, q_valid = min(kTile, n - q0);
  const int k_end = p.causal ? min(n, q0 + kTile) : n;
  load_tile<T, D>(p.q, p.grad_scaled, b, h, q0, q_valid, qf, gt, inv_rms);
  if (threadIdx.x < kTile) {
    gd[threadIdx.x] =
        threadIdx.x < q_valid ? p.grad_den[static_cast<size_t>(bh) * n + q0 + threadIdx.x] : 0.f;
  }
  RowsAcc<T, D> dq;
  dq.zero();

  const int r = threadIdx.x / 4, c0 = (threadIdx.x % 4) * 16, t = q0 + r;
  for (int k0 = 0; k0 < k_end; k0 += kTile) {
    const int k_valid = min(kTile, n - k0);
    __syncthreads();
    load_tile<T, D>(p.k, p.v, b, h, k0, k_valid, kf, vt, nullptr);
    __syncthreads();
    square_product<T, D>(gt, vt, dp);
    __syncthreads();
#pragma unroll 4
    for (int c = c0; c < c0 + 16; ++c) {
      const int key = k0 + c;
      const float w =
          (t < n && key < n) ? mixing_weight(p.mixing, s.blocks, length, p.causal, t, key) : 0.f;
      da[r * kSquareE + c] = from_float<E>((dp[r * kSquareF + c] + gd[r]) * w);
    }
    __syncthreads();
    dq.add_product(da, kf);  // dphi(q_t) += sum_s dA_ts phi(k_s)
  }
  __syncthreads();
  dq.store(dq_rows);
  __syncthreads();
  T* grad_q = static_cast<T*>(p.grad_q);
  const int lane = threadIdx.x % L::lanes;
  for (int row = threadIdx.x / L::lanes; row < kTile; row += L::rows_per_pass) {  // whole warps
    float x[L::vec], g[L::vec];
    const bool live = row < q_valid;
    if (live) load_vector<T, D>(token_row<T, D>(p.q, b, q0 + row, h) + lane * L::vec, x);
#pragma unroll
    for (int i = 0; i < L::vec; ++i) {
      if (!live) x[i] = 0.f;
      g[i] = live ? dq_rows[row * L::ldf + lane * L::vec + i] : 0.f;
    }
    feature_backward<T, D>(x, live ? inv_rms[row] : 0.f, g);
    const size_t index = (static_cast<size_t>(b) * n + q0 + row) * s.heads + h;
    if (live) store_vector<T, D>(grad_q + index * D + lane * L::vec, g);
  }
}

template <typename T, int D>
bool fits(const BlockLinearShape& s) {
  using S = DenseSmem<T, D>;
  return S::forward <= kMaxSmem && S::queries <= kMaxSmem && S::keys(s.blocks) <= kMaxSmem;
}

template <typename T, int D>
cudaError_t dense_forward_for(const DenseBlockLinearForward& a, cudaStream_t stream) {
  const auto& s = a.shape;
  const dim3 grid((s.tokens + kTile - 1) / kTile, s.batch * s.heads);
  constexpr size_t bytes = DenseSmem<T, D>::forward;
  cudaError_t err = allow_smem(dense_forward_kernel<T, D>, bytes);
  if (err != cudaSuccess) return err;
  dense_forward_kernel<T, D><<<grid, kThreads, bytes, stream>>>(a);
  return cudaGetLastError();
}

template <typename T, int D>
cudaError_t dense_backward_for(const DenseBlockLinearBackward& a, cudaStream_t stream) {
  const auto& s = a.shape;
  const dim3 grid((s.tokens + kTile - 1) / kTile, s.batch * s.heads);
  cudaError_t err = cudaSuccess;
  if (a.mixing != nullptr &&
      (err = cudaMemsetAsync(a.grad_mixing, 0, sizeof(float) * s.blocks * s.blocks, stream)) !=
          cudaSuccess)
    return err;
  const size_t key_bytes = DenseSmem<T, D>::keys(a.mixing != nullptr ? s.blocks : 0);
  if ((err = allow_smem(dense_keys_kernel<T, D>, key_bytes)) != cudaSuccess) return err;
  dense_keys_kernel<T, D><<<grid, kThreads, key_bytes, stream>>>(a);
  constexpr size_t query_bytes = DenseSmem<T, D>::queries;
  if ((err = allow_smem(dense_queries_kernel<T, D>, query_bytes)) != cudaSuccess) return err;
  dense_queries_kernel<T, D><<<grid, kThreads, query_bytes, stream>>>(a);
  return cudaGetLastError();
}

template <typename T, int D>
struct DenseForwardPass {
  static cudaError_t run(const DenseBlockLinearForward& a, cudaStream_t s) {
    return dense_forward_for<T, D>(a, s);
  }
};
template <typename T, int D>
struct DenseBackwardPass {
  static cudaError_t run(const DenseBlockLinearBackward& a, cudaStream_t s) {
    return dense_backward_for<T, D>(a, s);
  }
};

}  // namespace

bool dense_block_linear_supported(const BlockLinearShape& s, DType dtype, bool causal) {
  if (s.blocks < 1 || s.blocks > 64 || s.tokens <= 0) return false;  // before any division
  const bool blocks_ok =
      causal ? s.blocks == (s.tokens + kDenseCausalBlock - 1) / kDenseCausalBlock
             : s.tokens % s.blocks == 0;
  const bool shape_ok = (s.head_dim == 32 || s.head_dim == 64 || s.head_dim == 128) &&
                        s.batch > 0 && s.heads > 0 && s.tokens > 0 && s.blocks >= 1 &&
                        s.blocks <= 64 && blocks_ok &&
                        static_cast<int64_t>(s.batch) * s.heads <= 65535;
  if (!shape_ok) return false;
  auto by_dim = [&](auto tag) {
    using T = decltype(tag);
    switch (s.head_dim) {
      case 32:
        return fits<T, 32>(s);
      case 64:
        return fits<T, 64>(s);
      default:
        return fits<T, 128>(s);
    }
  };
  switch (dtype) {
    case DType::f32:
      return by_dim(float{});
    case DType::f16:
      return by_dim(__half{});
    case DType::bf16:
      return by_dim(__nv_bfloat16{});
  }
  return false;
}

cudaError_t dense_block_linear_forward(const DenseBlockLinearForward& args, cudaStream_t stream) {
  if (!dense_block_linear_supported(args.shape, args.dtype, args.causal) || args.den == nullptr)
    return cudaErrorInvalidValue;
  auto run = launcher_for<DenseBlockLinearForward, DenseForwardPass>(args.dtype,
                                                                     args.shape.head_dim);
  return run != nullptr ? run(args, stream) : cudaErrorInvalidValue;
}

cudaError_t dense_block_linear_backward(const DenseBlockLinearBackward& args, cudaStream_t stream) {
  if (!dense_block_linear_supported(args.shape, args.dtype, args.causal) ||
      args.grad_den == nullptr ||
      (args.mixing != nullptr && args.grad_mixing == nullptr))
    return cudaErrorInvalidValue;
  auto run = launcher_for<DenseBlockLinearBackward, DenseBackwardPass>(args.dtype,
                                                                       args.shape.head_dim);
  return run != nullptr ? run(args, stream) : cudaErrorInvalidValue;
}

}  // namespace mhla_kernels
