#include "adaln/adaln.h"

#include <algorithm>
#include <initializer_list>
#include <type_traits>
#include <utility>

#include "common/element_type.cuh"
#include "common/row_kernels.cuh"

namespace mhla_kernels {
namespace {

constexpr int kForwardWarps = 8;
constexpr int kBackwardWarps = 4;
// CTAs per launch to aim for: each CTA takes rows of one sample, so that the per-sample vectors
// are loaded once per warp and the backward's column sums stay per sample.
constexpr int64_t kTargetCtas = 2048;

// A row is held as CHUNKS x VEC values per lane (CHUNKS x 32 x VEC >= cols), like the LayerNorm
// kernels; in the forward the per-sample vectors a lane needs sit in registers the same way.
template <int VEC, int kChunks>
__device__ __forceinline__ void load_sample_vector(const SampleVectors& v, int64_t sample, int lane,
                                                   int cols, float fallback,
                                                   float (&out)[kChunks][VEC]) {
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    const int col = (c * 32 + lane) * VEC;
    if (v.data != nullptr && col < cols) {
      load_pack<float, VEC>(v.data + sample * v.stride + col, out[c]);
    } else {
#pragma unroll
      for (int i = 0; i < VEC; ++i) out[c][i] = fallback;
    }
  }
}

// Rows [begin, end) of this CTA's sample.
struct RowRange {
  int64_t first_row, begin, end;
};

__device__ __forceinline__ RowRange cta_rows(int64_t rows_per_sample, int64_t rows_per_cta) {
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * rows_per_cta;
  const int64_t end =
      begin + rows_per_cta < rows_per_sample ? begin + rows_per_cta : rows_per_sample;
  return {static_cast<int64_t>(blockIdx.y) * rows_per_sample, begin, end};
}

template <typename T, int VEC, int kChunks, bool kResidual>
__global__ void __launch_bounds__(kForwardWarps * 32)
    forward_kernel(AdaLnForwardArgs p, int64_t rows_per_cta) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int cols = p.cols;
  const int64_t sample = blockIdx.y;
  float shift[kChunks][VEC], scale1p[kChunks][VEC], gate[kChunks][VEC];
  load_sample_vector(p.shift, sample, lane, cols, 0.f, shift);
  load_sample_vector(p.scale, sample, lane, cols, 0.f, scale1p);
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
#pragma unroll
    for (int i = 0; i < VEC; ++i) scale1p[c][i] += 1.f;
  }
  if constexpr (kResidual) load_sample_vector(p.gate, sample, lane, cols, 1.f, gate);

  const RowRange range = cta_rows(p.rows_per_sample, rows_per_cta);
  for (int64_t r = range.begin + warp; r < range.end; r += kForwardWarps) {
    const int64_t offset = (range.first_row + r) * cols;
    float values[kChunks][VEC];
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      const int col = (c * 32 + lane) * VEC;
      if (col < cols) {
        load_pack<float, VEC>(p.x + offset + col, values[c]);
        if constexpr (kResidual) {
          float branch[VEC];
          load_pack<T, VEC>(static_cast<const T*>(p.branch) + offset + col, branch);
#pragma unroll
          for (int i = 0; i < VEC; ++i) values[c][i] += gate[c][i] * branch[i];
          store_pack<float, VEC>(p.sum + offset + col, values[c]);
        }
      }
    }
    float mean, rstd;
    row_moments(values, lane, cols, p.eps, mean, rstd);
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      const int col = (c * 32 + lane) * VEC;
      if (col < cols) {
        float out[VEC];
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          out[i] = (values[c][i] - mean) * rstd * scale1p[c][i] + shift[c][i];
        }
        store_pack<T, VEC>(static_cast<T*>(p.normed) + offset + col, out);
      }
    }
    if (lane == 0 && p.mean != nullptr) {
      p.mean[range.first_row + r] = mean;
      p.rstd[range.first_row + r] = rstd;
    }
  }
}

// Per row: g = d normed, xhat the normalized sum, w = 1 + scale;
//   d shift += g, d scale += g xhat (column sums over the sample's rows),
//   d sum = rstd (w g - mean(w g) - xhat mean(w g xhat)) + dsum,
//   d branch = gate d sum, d gate += d sum * branch.
// The sample's w and gate and each warp's column sums sit in shared memory, not registers: at
// DiT-S's width that leaves 80 registers and 6 CTAs per SM, and with the four row loads issued
// before the row's reductions the kernel moves 3.75 TB/s (0.48 ms per call at 1,024 tokens,
// against 0.72 ms for the same arithmetic with register sums, session 19). The CTA then adds its
// warps' sums and writes one [3, cols] partial for its sample.
template <typename T, int VEC, int kChunks, bool kResidual>
__global__ void __launch_bounds__(kBackwardWarps * 32, kChunks <= 3 ? 6 : 1)
    backward_kernel(AdaLnBackwardArgs p, int64_t rows_per_cta) {
  extern __shared__ float smem[];  // scale1p [cols], gate [cols], then [kBackwardWarps][3][cols]
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int cols = p.cols;
  const int64_t sample = blockIdx.y;
  float* scale1p = smem;
  float* gate = smem + cols;
  float* sums = smem + 2 * cols;
  for (int i = threadIdx.x; i < cols; i += blockDim.x) {
    scale1p[i] = 1.f + p.scale.data[sample * p.scale.stride + i];
    gate[i] = kResidual && p.gate.data ? p.gate.data[sample * p.gate.stride + i] : 1.f;
  }
  for (int i = threadIdx.x; i < kBackwardWarps * 3 * cols; i += blockDim.x) sums[i] = 0.f;
  __syncthreads();
  float* dshift = sums + warp * 3 * cols;
  float* dscale = dshift + cols;
  float* dgate = dscale + cols;

  const RowRange range = cta_rows(p.rows_per_sample, rows_per_cta);
  for (int64_t r = range.begin + warp; r < range.end; r += kBackwardWarps) {
    const int64_t row = range.first_row + r;
    const int64_t offset = row * cols;
    float xhat[kChunks][VEC], wg[kChunks][VEC], carried[kChunks][VEC], branch[kChunks][VEC];
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      const int col = (c * 32 + lane) * VEC;
      if (col < cols) {
        load_pack<float, VEC>(p.sum + offset + col, xhat[c]);
        load_pack<T, VEC>(static_cast<const T*>(p.dnormed) + offset + col, wg[c]);
        if (p.dsum != nullptr) load_pack<float, VEC>(p.dsum + offset + col, carried[c]);
        if constexpr (kResidual) {
          load_pack<T, VEC>(static_cast<const T*>(p.branch) + offset + col, branch[c]);
        }
      }
    }
    const float mean = p.mean[row], rstd = p.rstd[row];
    float sum_wg = 0.f, sum_wg_xhat = 0.f;
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      const int col = (c * 32 + lane) * VEC;
      if (col < cols) {
        float w[VEC], acc_shift[VEC], acc_scale[VEC];
        load_pack<float, VEC>(scale1p + col, w);
        load_pack<float, VEC>(dshift + col, acc_shift);
        load_pack<float, VEC>(dscale + col, acc_scale);
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          xhat[c][i] = (xhat[c][i] - mean) * rstd;
          acc_shift[i] += wg[c][i];
          acc_scale[i] += wg[c][i] * xhat[c][i];
          wg[c][i] *= w[i];
          sum_wg += wg[c][i];
          sum_wg_xhat += wg[c][i] * xhat[c][i];
        }
        store_pack<float, VEC>(dshift + col, acc_shift);
        store_pack<float, VEC>(dscale + col, acc_scale);
      }
    }
    const float mean_wg = warp_sum(sum_wg) / cols;
    const float mean_wg_xhat = warp_sum(sum_wg_xhat) / cols;
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      const int col = (c * 32 + lane) * VEC;
      if (col < cols) {
        float d[VEC];
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          d[i] = rstd * (wg[c][i] - mean_wg - xhat[c][i] * mean_wg_xhat);
          if (p.dsum != nullptr) d[i] += carried[c][i];
        }
        store_pack<float, VEC>(p.dx + offset + col, d);
        if constexpr (kResidual) {
          float g[VEC], acc_gate[VEC], scaled[VEC];
          load_pack<float, VEC>(gate + col, g);
          load_pack<float, VEC>(dgate + col, acc_gate);
#pragma unroll
          for (int i = 0; i < VEC; ++i) {
            acc_gate[i] += d[i] * branch[c][i];
            scaled[i] = g[i] * d[i];
          }
          store_pack<float, VEC>(dgate + col, acc_gate);
          store_pack<T, VEC>(static_cast<T*>(p.dbranch) + offset + col, scaled);
        }
      }
    }
  }
  __syncthreads();
  float* out = p.workspace + (static_cast<int64_t>(blockIdx.x) * gridDim.y + sample) * 3 * cols;
  for (int i = threadIdx.x; i < 3 * cols; i += blockDim.x) {
    float total = 0.f;
#pragma unroll
    for (int w = 0; w < kBackwardWarps; ++w) total += sums[w * 3 * cols + i];
    out[i] = total;
  }
}

// 4-wide accesses where the row length, every row pointer and every per-sample vector allow.
int vector_width(int cols, std::initializer_list<std::pair<const void*, int>> rows,
                 std::initializer_list<SampleVectors> vectors) {
  if (cols % 4 != 0) return 1;
  for (auto [ptr, elem_bytes] : rows) {
    if (ptr != nullptr && !is_aligned(ptr, 4 * elem_bytes)) return 1;
  }
  for (const auto& v : vectors) {
    if (v.data != nullptr && (!is_aligned(v.data, 16) || v.stride % 4 != 0)) return 1;
  }
  return 4;
}

int64_t ctas_per_sample(int64_t samples, int64_t rows_per_sample, int warps) {
  const int64_t most = (rows_per_sample + warps - 1) / warps;  // at least a row per warp
  const int64_t wanted = samples > 0 ? (kTargetCtas + samples - 1) / samples : 1;
  return std::max<int64_t>(1, std::min(most, wanted));
}

bool valid_shape(int64_t samples, int64_t rows_per_sample, int cols) {
  return samples >= 0 && samples <= 65535 && rows_per_sample >= 0 && cols > 0 &&
         cols <= kAdaLnMaxColumns;
}

}  // namespace

cudaError_t adaln_forward(const AdaLnForwardArgs& a, cudaStream_t stream) {
  const bool residual = a.branch != nullptr;
  if (!valid_shape(a.samples, a.rows_per_sample, a.cols) || !a.x || !a.normed || !a.shift.data ||
      !a.scale.data || (a.mean == nullptr) != (a.rstd == nullptr) || (residual && !a.sum)) {
    return cudaErrorInvalidValue;
  }
  if (a.samples == 0 || a.rows_per_sample == 0) return cudaSuccess;
  const int bytes = dtype_bytes(a.dtype);
  const int vec = vector_width(a.cols, {{a.x, 4}, {a.sum, 4}, {a.branch, bytes}, {a.normed, bytes}},
                               {a.shift, a.scale, a.gate});
  const int64_t ctas = ctas_per_sample(a.samples, a.rows_per_sample, kForwardWarps);
  const int64_t rows_per_cta = (a.rows_per_sample + ctas - 1) / ctas;
  const dim3 grid(static_cast<unsigned>(ctas), static_cast<unsigned>(a.samples));
  return with_element_type(a.dtype, [&](auto tag) {
    using T = decltype(tag);
    return with_row_chunks<kAdaLnMaxColumns>(vec, a.cols, [&](auto v, auto chunks) {
      constexpr int kVec = decltype(v)::value, kChunks = decltype(chunks)::value;
      if (residual) {
        forward_kernel<T, kVec, kChunks, true>
            <<<grid, kForwardWarps * 32, 0, stream>>>(a, rows_per_cta);
      } else {
        forward_kernel<T, kVec, kChunks, false>
            <<<grid, kForwardWarps * 32, 0, stream>>>(a, rows_per_cta);
      }
      return cudaGetLastError();
    });
  });
}

size_t adaln_backward_workspace_floats(int64_t samples, int64_t rows_per_sample, int cols) {
  return static_cast<size_t>(ctas_per_sample(samples, rows_per_sample, kBackwardWarps)) *
         static_cast<size_t>(samples) * 3 * static_cast<size_t>(cols);
}

cudaError_t adaln_backward(const AdaLnBackwardArgs& a, cudaStream_t stream) {
  const bool residual = a.branch != nullptr;
  if (!valid_shape(a.samples, a.rows_per_sample, a.cols) || !a.sum || !a.dnormed || !a.mean ||
      !a.rstd || !a.scale.data || !a.dx || !a.dmodulation || !a.workspace ||
      (residual && !a.dbranch)) {
    return cudaErrorInvalidValue;
  }
  const int64_t modulation_floats = a.samples * 3 * a.cols;
  if (a.samples == 0) return cudaSuccess;
  if (a.rows_per_sample == 0) {
    cudaMemsetAsync(a.dmodulation, 0, sizeof(float) * modulation_floats, stream);
    return cudaGetLastError();
  }
  const int bytes = dtype_bytes(a.dtype);
  const int vec = vector_width(a.cols,
                               {{a.sum, 4},
                                {a.dsum, 4},
                                {a.dx, 4},
                                {a.dnormed, bytes},
                                {a.branch, bytes},
                                {a.dbranch, bytes}},
                               {a.scale, a.gate});
  const int64_t ctas = ctas_per_sample(a.samples, a.rows_per_sample, kBackwardWarps);
  const int64_t rows_per_cta = (a.rows_per_sample + ctas - 1) / ctas;
  const dim3 grid(static_cast<unsigned>(ctas), static_cast<unsigned>(a.samples));
  const size_t shared = sizeof(float) * (kBackwardWarps * 3 + 2) * a.cols;
  const cudaError_t err = with_element_type(a.dtype, [&](auto tag) {
    using T = decltype(tag);
    return with_row_chunks<kAdaLnMaxColumns>(vec, a.cols, [&](auto v, auto chunks) {
      constexpr int kVec = decltype(v)::value, kChunks = decltype(chunks)::value;
      auto kernel = residual ? backward_kernel<T, kVec, kChunks, true>
                             : backward_kernel<T, kVec, kChunks, false>;
      if (shared > 48 * 1024) {
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             static_cast<int>(shared));
      }
      kernel<<<grid, kBackwardWarps * 32, shared, stream>>>(a, rows_per_cta);
      return cudaGetLastError();
    });
  });
  if (err != cudaSuccess) return err;
  return sum_cta_partials(a.workspace, static_cast<int>(ctas), modulation_floats, a.dmodulation,
                          stream);
}

}  // namespace mhla_kernels
