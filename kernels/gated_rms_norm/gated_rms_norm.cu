#include "gated_rms_norm/gated_rms_norm.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "common/packed_access.cuh"
#include "common/row_kernels.cuh"

namespace mhla_kernels {
namespace {

constexpr int kForwardWarps = 8;
constexpr int kBackwardWarps = 4;
constexpr int kBackwardMaxCtas = 1024;

__device__ __forceinline__ float sigmoid(float x) { return 1.f / (1.f + __expf(-x)); }

// One warp per vector; lane l holds elements [l E, l E + E).
template <typename T, int E>
__global__ void __launch_bounds__(kForwardWarps * 32) forward_kernel(GatedRmsNormArgs a) {
  const int lane = threadIdx.x % 32;
  const int64_t vector = static_cast<int64_t>(blockIdx.x) * kForwardWarps + threadIdx.x / 32;
  if (vector >= a.vectors) return;
  const int64_t offset = vector * a.dim + lane * E;
  float x[E], g[E];
  load_pack<T, E>(static_cast<const T*>(a.x) + offset, x);
  load_pack<T, E>(static_cast<const T*>(a.gate) + offset, g);
  float squares = 0.f;
#pragma unroll
  for (int i = 0; i < E; ++i) squares += x[i] * x[i];
  const float rstd = rsqrtf(warp_sum(squares) / a.dim + a.eps);
  float y[E];
#pragma unroll
  for (int i = 0; i < E; ++i) y[i] = x[i] * rstd * a.weight[lane * E + i] * g[i] * sigmoid(g[i]);
  store_pack<T, E>(static_cast<T*>(a.y) + offset, y);
  if (lane == 0) a.rstd[vector] = rstd;
}

template <typename T, int E>
__global__ void __launch_bounds__(kBackwardWarps * 32) backward_kernel(GatedRmsNormArgs a) {
  __shared__ float partial[kBackwardWarps][256];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  float dw[E] = {};
  float w[E];
#pragma unroll
  for (int i = 0; i < E; ++i) w[i] = a.weight[lane * E + i];
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kBackwardWarps;
  for (int64_t vector = static_cast<int64_t>(blockIdx.x) * kBackwardWarps + warp;
       vector < a.vectors; vector += stride) {
    const int64_t offset = vector * a.dim + lane * E;
    float x[E], g[E], dy[E];
    load_pack<T, E>(static_cast<const T*>(a.x) + offset, x);
    load_pack<T, E>(static_cast<const T*>(a.gate) + offset, g);
    load_pack<T, E>(static_cast<const T*>(a.dy) + offset, dy);
    const float rstd = a.rstd[vector];
    float n[E], dn[E], dg[E];
    float dot = 0.f;
#pragma unroll
    for (int i = 0; i < E; ++i) {
      const float sig = sigmoid(g[i]);
      const float s = g[i] * sig;
      n[i] = x[i] * rstd;
      dn[i] = dy[i] * w[i] * s;
      dot += dn[i] * n[i];
      dw[i] += dy[i] * n[i] * s;
      dg[i] = dy[i] * n[i] * w[i] * sig * (1.f + g[i] * (1.f - sig));
    }
    const float mean_dot = warp_sum(dot) / a.dim;
    float dx[E];
#pragma unroll
    for (int i = 0; i < E; ++i) dx[i] = rstd * (dn[i] - n[i] * mean_dot);
    store_pack<T, E>(static_cast<T*>(a.dx) + offset, dx);
    store_pack<T, E>(static_cast<T*>(a.dgate) + offset, dg);
  }
#pragma unroll
  for (int i = 0; i < E; ++i) partial[warp][lane * E + i] = dw[i];
  __syncthreads();
  for (int d = threadIdx.x; d < a.dim; d += blockDim.x) {
    float total = 0.f;
#pragma unroll
    for (int k = 0; k < kBackwardWarps; ++k) total += partial[k][d];
    a.workspace[static_cast<int64_t>(blockIdx.x) * a.dim + d] = total;
  }
}

int backward_ctas(int64_t vectors) {
  return static_cast<int>(
      std::min<int64_t>((vectors + kBackwardWarps - 1) / kBackwardWarps, kBackwardMaxCtas));
}

}  // namespace

bool gated_rms_norm_supports(int dim) {
  return dim == 32 || dim == 64 || dim == 128 || dim == 256;
}

size_t gated_rms_norm_workspace_floats(int64_t vectors, int dim) {
  return static_cast<size_t>(std::max(backward_ctas(vectors), 1)) * static_cast<size_t>(dim);
}

cudaError_t gated_rms_norm_forward(const GatedRmsNormArgs& a, cudaStream_t stream) {
  if (!gated_rms_norm_supports(a.dim) || a.vectors < 0 || !a.x || !a.gate || !a.weight ||
      !a.rstd || !a.y || (a.vectors + kForwardWarps - 1) / kForwardWarps > 0x7fffffff) {
    return cudaErrorInvalidValue;
  }
  if (a.vectors == 0) return cudaSuccess;
  return with_element_type(a.dtype, [&](auto tag) {
    using T = decltype(tag);
    return with_lanes_per_warp<256>(a.dim, [&](auto e) {
      constexpr int E = decltype(e)::value;
      const int bytes = static_cast<int>(sizeof(T)) * E;
      if (!is_aligned(a.x, bytes) || !is_aligned(a.gate, bytes) || !is_aligned(a.y, bytes)) {
        return cudaErrorMisalignedAddress;
      }
      const dim3 grid(static_cast<unsigned>((a.vectors + kForwardWarps - 1) / kForwardWarps));
      forward_kernel<T, E><<<grid, kForwardWarps * 32, 0, stream>>>(a);
      return cudaGetLastError();
    });
  });
}

cudaError_t gated_rms_norm_backward(const GatedRmsNormArgs& a, cudaStream_t stream) {
  if (!gated_rms_norm_supports(a.dim) || a.vectors < 0 || !a.x || !a.gate || !a.weight ||
      !a.rstd || !a.dy || !a.dx || !a.dgate || !a.dweight || !a.workspace) {
    return cudaErrorInvalidValue;
  }
  if (a.vectors == 0) return cudaMemsetAsync(a.dweight, 0, sizeof(float) * a.dim, stream);
  const int ctas = backward_ctas(a.vectors);
  const cudaError_t err = with_element_type(a.dtype, [&](auto tag) {
    using T = decltype(tag);
    return with_lanes_per_warp<256>(a.dim, [&](auto e) {
      constexpr int E = decltype(e)::value;
      const int bytes = static_cast<int>(sizeof(T)) * E;
      if (!is_aligned(a.x, bytes) || !is_aligned(a.gate, bytes) || !is_aligned(a.dy, bytes) ||
          !is_aligned(a.dx, bytes) || !is_aligned(a.dgate, bytes)) {
        return cudaErrorMisalignedAddress;
      }
      backward_kernel<T, E><<<ctas, kBackwardWarps * 32, 0, stream>>>(a);
      return cudaGetLastError();
    });
  });
  if (err != cudaSuccess) return err;
  return sum_cta_partials(a.workspace, ctas, a.dim, a.dweight, stream);
}

}  // namespace mhla_kernels
