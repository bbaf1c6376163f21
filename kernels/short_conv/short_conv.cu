#include "short_conv/short_conv.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <type_traits>

#include "common/packed_access.cuh"
#include "common/row_kernels.cuh"

namespace mhla_kernels {
namespace {

constexpr int W = kShortConvWidth;
constexpr int kWarps = 4;             // per CTA, all on one (part, head) column
constexpr int kRun = 64;              // tokens per warp item: the backward recomputes W - 1 more
constexpr int kBackwardMaxCtas = 128;  // per column: the dw partials of the workspace
constexpr int kMaxHeadDim = 128;
// G: tokens whose loads are issued together (4 by default; MHLA_SHORT_CONV_GROUP=1 or 2 for A/B
// runs). A warp's steps are serial, so one load at a time leaves it waiting on memory latency;
// more in flight costs registers (the unrolled steps).
constexpr int kDefaultGroup = 4;

__device__ __forceinline__ float sigmoid(float x) { return 1.f / (1.f + __expf(-x)); }

// What a warp needs to find its column and its runs of tokens.
struct Column {
  int part, head, column;
  int64_t row;  // elements per token of x: 3 H D
  int segments;
  int64_t runs;

  __device__ explicit Column(const ShortConvArgs& a)
      : part(blockIdx.y / a.heads),
        head(blockIdx.y % a.heads),
        column(blockIdx.y),
        row(3LL * a.heads * a.head_dim),
        segments((a.tokens + kRun - 1) / kRun),
        runs(static_cast<int64_t>(a.batch) * segments) {}
};

template <int E>
__device__ __forceinline__ void load_weights(const ShortConvArgs& a, int column, int lane,
                                             float (&w)[E][W]) {
  const float* src = a.weight + (static_cast<int64_t>(column) * a.head_dim + lane * E) * W;
#pragma unroll
  for (int e = 0; e < E; ++e) {
#pragma unroll
    for (int j = 0; j < W; ++j) w[e][j] = src[e * W + j];
  }
}

// Input token t of the (possibly reversed) sequence, as a row index of x.
__device__ __forceinline__ int source_token(const ShortConvArgs& a, int t) {
  return a.reversed ? a.tokens - 1 - t : t;
}

// The W - 1 inputs before token t0 (zeros before the sequence starts): a run's first window.
template <typename T, int E>
__device__ __forceinline__ void load_window(const ShortConvArgs& a, const T* xs, int64_t row,
                                            int t0, float (&window)[W - 1][E]) {
#pragma unroll
  for (int i = 0; i < W - 1; ++i) {
    const int t = t0 - (W - 1) + i;
    if (t >= 0) {
      load_pack<T, E>(xs + source_token(a, t) * row, window[i]);
    } else {
#pragma unroll
      for (int e = 0; e < E; ++e) window[i][e] = 0.f;
    }
  }
}

// grid (runs / kWarps, 3 H): one warp per run of kRun tokens of one sequence and column; lane l
// holds channels [l E, l E + E) and the last W - 1 input rows in registers.
template <typename T, int E, int G>
__global__ void __launch_bounds__(kWarps * 32) forward_kernel(ShortConvArgs a) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const Column c(a);
  const int D = a.head_dim, T_ = a.tokens;
  float w[E][W];
  load_weights<E>(a, c.column, lane, w);
  T* out = static_cast<T*>(c.part == 0 ? a.q : c.part == 1 ? a.k : a.v);
  const bool normalize = c.part < 2;  // q and k; uniform over the CTA
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * kWarps + warp; r < c.runs;
       r += static_cast<int64_t>(gridDim.x) * kWarps) {
    const int b = static_cast<int>(r / c.segments);
    const int t0 = static_cast<int>(r % c.segments) * kRun, t1 = min(t0 + kRun, T_);
    const T* xs = static_cast<const T*>(a.x) + static_cast<int64_t>(b) * T_ * c.row +
                  static_cast<int64_t>(c.column) * D + lane * E;
    float window[W - 1][E];  // inputs t - W + 1 .. t - 1
    load_window<T, E>(a, xs, c.row, t0, window);
    for (int g0 = t0; g0 < t1; g0 += G) {
      float group[G][E];
#pragma unroll
      for (int g = 0; g < G; ++g) {
        if (g0 + g < t1) {
          load_pack<T, E>(xs + source_token(a, g0 + g) * c.row, group[g]);
        } else {
#pragma unroll
          for (int e = 0; e < E; ++e) group[g][e] = 0.f;
        }
      }
#pragma unroll
      for (int g = 0; g < G; ++g) {
        const int t = g0 + g;
        if (t >= t1) break;  // uniform over the warp
        const float(&now)[E] = group[g];
        float s[E];
        float squares = 0.f;
#pragma unroll
        for (int e = 0; e < E; ++e) {
          float p = w[e][W - 1] * now[e];
#pragma unroll
          for (int i = 0; i < W - 1; ++i) p += w[e][i] * window[i][e];
          s[e] = p * sigmoid(p);
          squares += s[e] * s[e];
        }
        if (normalize) {
          const float inverse = 1.f / fmaxf(sqrtf(warp_sum(squares)), a.eps);
#pragma unroll
          for (int e = 0; e < E; ++e) s[e] *= inverse;
        }
        store_pack<T, E>(
            out + ((static_cast<int64_t>(b) * T_ + t) * a.heads + c.head) * D + lane * E, s);
#pragma unroll
        for (int e = 0; e < E; ++e) {
#pragma unroll
          for (int i = 0; i < W - 2; ++i) window[i][e] = window[i + 1][e];
          window[W - 2][e] = now[e];
        }
      }
    }
  }
}

// Same grid and runs as the forward, at most kBackwardMaxCtas CTAs per column. Each run
// recomputes p over its tokens and the W - 1 after it (their dp reach its last dx rows), keeps the
// last W - 1 inputs and dp in registers, and writes dx[t - W + 1] once dp[t] is known. dw
// accumulates in registers over a warp's runs, then per CTA into the workspace.
template <typename T, int E, int G>
__global__ void __launch_bounds__(kWarps * 32) backward_kernel(ShortConvArgs a) {
  __shared__ float partial[kWarps][kMaxHeadDim * W];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const Column c(a);
  const int D = a.head_dim, T_ = a.tokens;
  float w[E][W];
  load_weights<E>(a, c.column, lane, w);
  const T* d_out = static_cast<const T*>(c.part == 0 ? a.dq : c.part == 1 ? a.dk : a.dv);
  const bool normalize = c.part < 2;
  float dw[E][W] = {};
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * kWarps + warp; r < c.runs;
       r += static_cast<int64_t>(gridDim.x) * kWarps) {
    const int b = static_cast<int>(r / c.segments);
    const int t0 = static_cast<int>(r % c.segments) * kRun, t1 = min(t0 + kRun, T_);
    const int64_t x_offset = static_cast<int64_t>(b) * T_ * c.row +
                             static_cast<int64_t>(c.column) * D + lane * E;
    const T* xs = static_cast<const T*>(a.x) + x_offset;
    T* dxs = static_cast<T*>(a.dx) + x_offset;
    float window[W - 1][E], dp_window[W - 1][E] = {};  // inputs and dp at t - W + 1 .. t - 1
    load_window<T, E>(a, xs, c.row, t0, window);
    const int end = t1 + W - 1, last = min(end, T_);  // dp is zero from T on
    for (int g0 = t0; g0 < end; g0 += G) {
      float x_group[G][E], dy_group[G][E];
#pragma unroll
      for (int g = 0; g < G; ++g) {
        const int t = g0 + g;
        if (t < last) {
          load_pack<T, E>(xs + source_token(a, t) * c.row, x_group[g]);
          load_pack<T, E>(
              d_out + ((static_cast<int64_t>(b) * T_ + t) * a.heads + c.head) * D + lane * E,
              dy_group[g]);
        } else {
#pragma unroll
          for (int e = 0; e < E; ++e) x_group[g][e] = dy_group[g][e] = 0.f;
        }
      }
#pragma unroll
      for (int g = 0; g < G; ++g) {
        const int t = g0 + g;
        if (t >= end) break;  // uniform over the warp
        const float(&now)[E] = x_group[g];
        const float(&dy)[E] = dy_group[g];
        float dp[E] = {};
        if (t < last) {  // uniform over the warp
          float p[E], sig[E], s[E];
          float squares = 0.f;
#pragma unroll
          for (int e = 0; e < E; ++e) {
            p[e] = w[e][W - 1] * now[e];
#pragma unroll
            for (int i = 0; i < W - 1; ++i) p[e] += w[e][i] * window[i][e];
            sig[e] = sigmoid(p[e]);
            s[e] = p[e] * sig[e];
            squares += s[e] * s[e];
          }
          float ds[E];
          if (normalize) {
            const float norm = sqrtf(warp_sum(squares));
            if (norm > a.eps) {
              const float inverse = 1.f / norm;
              float dot = 0.f;
#pragma unroll
              for (int e = 0; e < E; ++e) dot += s[e] * dy[e];
              const float projection = warp_sum(dot) * inverse * inverse;  // y . dy / n
#pragma unroll
              for (int e = 0; e < E; ++e) ds[e] = (dy[e] - s[e] * projection) * inverse;
            } else {  // the norm was clamped to eps: y = s / eps
#pragma unroll
              for (int e = 0; e < E; ++e) ds[e] = dy[e] / a.eps;
            }
          } else {
#pragma unroll
            for (int e = 0; e < E; ++e) ds[e] = dy[e];
          }
#pragma unroll
          for (int e = 0; e < E; ++e) {
            dp[e] = ds[e] * sig[e] * (1.f + p[e] * (1.f - sig[e]));
            if (t < t1) {  // each token's dp counts in dw once, in the run that owns it
#pragma unroll
              for (int j = 0; j < W - 1; ++j) dw[e][j] += dp[e] * window[j][e];
              dw[e][W - 1] += dp[e] * now[e];
            }
          }
        }
        const int u = t - (W - 1);  // dx[u] = sum_j w[j] dp[u + W - 1 - j] = sum_j w[j] dp[t - j]
        if (u >= t0) {
          float dx[E];
#pragma unroll
          for (int e = 0; e < E; ++e) {
            dx[e] = w[e][0] * dp[e];
#pragma unroll
            for (int j = 1; j < W; ++j) dx[e] += w[e][j] * dp_window[W - 1 - j][e];
          }
          store_pack<T, E>(dxs + source_token(a, u) * c.row, dx);
        }
#pragma unroll
        for (int e = 0; e < E; ++e) {
#pragma unroll
          for (int i = 0; i < W - 2; ++i) {
            window[i][e] = window[i + 1][e];
            dp_window[i][e] = dp_window[i + 1][e];
          }
          window[W - 2][e] = now[e];
          dp_window[W - 2][e] = dp[e];
        }
      }
    }
  }
#pragma unroll
  for (int e = 0; e < E; ++e) {
#pragma unroll
    for (int j = 0; j < W; ++j) partial[warp][(lane * E + e) * W + j] = dw[e][j];
  }
  __syncthreads();
  float* slot = a.workspace + (static_cast<int64_t>(blockIdx.x) * gridDim.y + c.column) * D * W;
  for (int i = threadIdx.x; i < D * W; i += blockDim.x) {
    float total = 0.f;
#pragma unroll
    for (int k = 0; k < kWarps; ++k) total += partial[k][i];
    slot[i] = total;
  }
}

int64_t runs_of(const ShortConvArgs& a) {
  return static_cast<int64_t>(a.batch) * ((a.tokens + kRun - 1) / kRun);
}

int backward_ctas(const ShortConvArgs& a) {
  return static_cast<int>(std::clamp<int64_t>((runs_of(a) + kWarps - 1) / kWarps, 1,
                                              kBackwardMaxCtas));
}

int load_group() {
  static const int group = [] {
    const char* forced = std::getenv("MHLA_SHORT_CONV_GROUP");
    const int g = forced ? std::atoi(forced) : kDefaultGroup;
    return g == 1 || g == 2 || g == 4 ? g : kDefaultGroup;
  }();
  return group;
}

template <typename F>
cudaError_t with_load_group(F&& f) {
  switch (load_group()) {
    case 1:
      return f(std::integral_constant<int, 1>{});
    case 2:
      return f(std::integral_constant<int, 2>{});
    default:
      return f(std::integral_constant<int, 4>{});
  }
}

bool valid_shape(const ShortConvArgs& a) {
  return short_conv_supports(a.head_dim, W) && a.batch >= 0 && a.tokens >= 0 && a.heads > 0 &&
         3 * a.heads <= 65535 && a.x && a.weight;
}

}  // namespace

bool short_conv_supports(int head_dim, int width) {
  return width == W && (head_dim == 32 || head_dim == 64 || head_dim == 128);
}

size_t short_conv_workspace_floats(const ShortConvArgs& a) {
  return static_cast<size_t>(backward_ctas(a)) * 3 * a.heads * a.head_dim * W;
}

cudaError_t short_conv_forward(const ShortConvArgs& a, cudaStream_t stream) {
  if (!valid_shape(a) || !a.q || !a.k || !a.v) return cudaErrorInvalidValue;
  const int64_t runs = runs_of(a);
  if (runs == 0) return cudaSuccess;
  if ((runs + kWarps - 1) / kWarps > 0x7fffffff) return cudaErrorInvalidValue;
  return with_element_type(a.dtype, [&](auto tag) {
    using T = decltype(tag);
    return with_lanes_per_warp<kMaxHeadDim>(a.head_dim, [&](auto e) {
      constexpr int E = decltype(e)::value;
      const int bytes = static_cast<int>(sizeof(T)) * E;
      if (!is_aligned(a.x, bytes) || !is_aligned(a.q, bytes) || !is_aligned(a.k, bytes) ||
          !is_aligned(a.v, bytes)) {
        return cudaErrorMisalignedAddress;
      }
      const dim3 grid(static_cast<unsigned>((runs + kWarps - 1) / kWarps),
                      static_cast<unsigned>(3 * a.heads));
      return with_load_group([&](auto g) {
        forward_kernel<T, E, decltype(g)::value><<<grid, kWarps * 32, 0, stream>>>(a);
        return cudaGetLastError();
      });
    });
  });
}

cudaError_t short_conv_backward(const ShortConvArgs& a, cudaStream_t stream) {
  if (!valid_shape(a) || !a.dq || !a.dk || !a.dv || !a.dx || !a.dweight || !a.workspace) {
    return cudaErrorInvalidValue;
  }
  const int64_t size = 3LL * a.heads * a.head_dim * W;
  if (runs_of(a) == 0) return cudaMemsetAsync(a.dweight, 0, sizeof(float) * size, stream);
  const int ctas = backward_ctas(a);
  const cudaError_t err = with_element_type(a.dtype, [&](auto tag) {
    using T = decltype(tag);
    return with_lanes_per_warp<kMaxHeadDim>(a.head_dim, [&](auto e) {
      constexpr int E = decltype(e)::value;
      const int bytes = static_cast<int>(sizeof(T)) * E;
      if (!is_aligned(a.x, bytes) || !is_aligned(a.dq, bytes) || !is_aligned(a.dk, bytes) ||
          !is_aligned(a.dv, bytes) || !is_aligned(a.dx, bytes)) {
        return cudaErrorMisalignedAddress;
      }
      const dim3 grid(static_cast<unsigned>(ctas), static_cast<unsigned>(3 * a.heads));
      return with_load_group([&](auto g) {
        backward_kernel<T, E, decltype(g)::value><<<grid, kWarps * 32, 0, stream>>>(a);
        return cudaGetLastError();
      });
    });
  });
  if (err != cudaSuccess) return err;
  return sum_cta_partials(a.workspace, ctas, size, a.dweight, stream);
}

}  // namespace mhla_kernels
