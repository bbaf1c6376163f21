#include "layer_norm/layer_norm.h"

#include <algorithm>
#include <initializer_list>
#include <type_traits>
#include <utility>

#include "common/element_type.cuh"
#include "common/partial_sums.cuh"
#include "common/row_kernels.cuh"

namespace mhla_kernels {
namespace {

constexpr int kForwardWarps = 8;   // one row per warp
constexpr int kBackwardWarps = 4;  // rows grid-strided over the warps of all CTAs
constexpr int kBackwardMaxCtas = 1024;

// A row is kept in registers as CHUNKS x VEC values per lane (CHUNKS x 32 x VEC >= cols): the
// launcher picks the smallest CHUNKS that covers the row, so short rows use few registers and
// many warps stay resident.

template <typename TIn, typename TOut, int VEC, int kChunks, bool kResidual>
__global__ void __launch_bounds__(kForwardWarps * 32) forward_kernel(LayerNormForwardArgs p) {
  const int lane = threadIdx.x % 32;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kForwardWarps + threadIdx.x / 32;
  if (row >= p.rows) return;
  const int cols = p.cols;
  const TIn* x = static_cast<const TIn*>(p.x) + row * cols;
  float values[kChunks][VEC];
  float scale = 1.f;
  if constexpr (kResidual) {
    if (p.scale) scale = p.scale[row / p.rows_per_sample];
  }
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    const int col = (c * 32 + lane) * VEC;
    if (col < cols) {
      load_pack<TIn, VEC>(x + col, values[c]);
      if constexpr (kResidual) {
        float branch[VEC];
        load_pack<TOut, VEC>(static_cast<const TOut*>(p.branch) + row * cols + col, branch);
#pragma unroll
        for (int i = 0; i < VEC; ++i) values[c][i] += scale * branch[i];
        store_pack<float, VEC>(p.sum + row * cols + col, values[c]);
      }
    }
  }
  float mean, rstd;
  row_moments(values, lane, cols, p.eps, mean, rstd);
  TOut* y = static_cast<TOut*>(p.y) + row * cols;
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    const int col = (c * 32 + lane) * VEC;
    if (col < cols) {
      float out[VEC];
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        const float w = p.weight ? p.weight[col + i] : 1.f;
        const float b = p.bias ? p.bias[col + i] : 0.f;
        out[i] = (values[c][i] - mean) * rstd * w + b;
      }
      store_pack<TOut, VEC>(y + col, out);
    }
  }
  if (lane == 0 && p.mean) {
    p.mean[row] = mean;
    p.rstd[row] = rstd;
  }
}

// dx = rstd (w dy - mean(w dy) - xhat mean(w dy xhat)); each warp takes rows in turn and adds
// dy xhat and dy into its own part of the weight/bias gradient (no atomics), the CTA then writes
// the sum of its warps' parts as one partial row of the workspace. A lane owns the same columns
// in every row, so rows of up to kRegisterSumElements per lane keep the part in registers; wider
// rows add into the warp's shared-memory slice, a read-modify-write per element and row.
constexpr int kRegisterSumElements = 24;
template <typename TIn, typename TGrad, int VEC, int kChunks, bool kResidual>
__global__ void __launch_bounds__(kBackwardWarps * 32) backward_kernel(LayerNormBackwardArgs p) {
  extern __shared__ float partial[];  // [kBackwardWarps][2][cols] when affine
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int cols = p.cols;
  const bool affine = p.weight != nullptr;
  float* dw_slice = partial + static_cast<int64_t>(warp) * 2 * cols;
  float* db_slice = dw_slice + cols;
  constexpr bool kInRegisters = kChunks * VEC <= kRegisterSumElements;
  float dw_part[kInRegisters ? kChunks : 1][VEC] = {};
  float db_part[kInRegisters ? kChunks : 1][VEC] = {};
  if (affine && !kInRegisters) {
    for (int i = lane; i < 2 * cols; i += 32) dw_slice[i] = 0.f;
    __syncwarp();  // the lanes below touch other lanes' zeroed columns
  }
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kBackwardWarps;
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * kBackwardWarps + warp; row < p.rows;
       row += stride) {
    const TIn* x = static_cast<const TIn*>(p.x) + row * cols;
    const TGrad* dy = static_cast<const TGrad*>(p.dy) + row * cols;
    const float mean = p.mean[row], rstd = p.rstd[row];
    float xhat[kChunks][VEC], wdy[kChunks][VEC];
    float sum_wdy = 0.f, sum_wdy_xhat = 0.f;
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      const int col = (c * 32 + lane) * VEC;
      if (col < cols) {
        float xv[VEC], gv[VEC];
        load_pack<TIn, VEC>(x + col, xv);
        load_pack<TGrad, VEC>(dy + col, gv);
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          xhat[c][i] = (xv[i] - mean) * rstd;
          const float w = affine ? p.weight[col + i] : 1.f;
          wdy[c][i] = w * gv[i];
          sum_wdy += wdy[c][i];
          sum_wdy_xhat += wdy[c][i] * xhat[c][i];
          if (affine) {
            if constexpr (kInRegisters) {
              dw_part[c][i] += gv[i] * xhat[c][i];
              db_part[c][i] += gv[i];
            } else {
              dw_slice[col + i] += gv[i] * xhat[c][i];
              db_slice[col + i] += gv[i];
            }
          }
        }
      }
    }
    const float mean_wdy = warp_sum(sum_wdy) / cols;
    const float mean_wdy_xhat = warp_sum(sum_wdy_xhat) / cols;
    TIn* dx = static_cast<TIn*>(p.dx) + row * cols;
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      const int col = (c * 32 + lane) * VEC;
      if (col < cols) {
        float out[VEC];
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          out[i] = rstd * (wdy[c][i] - mean_wdy - xhat[c][i] * mean_wdy_xhat);
        }
        if constexpr (kResidual) {
          if (p.dsum) {
            float carried[VEC];
            load_pack<float, VEC>(p.dsum + row * cols + col, carried);
#pragma unroll
            for (int i = 0; i < VEC; ++i) out[i] += carried[i];
          }
        }
        store_pack<TIn, VEC>(dx + col, out);
        if constexpr (kResidual) {
          if (p.dbranch) {
            const float scale = p.scale ? p.scale[row / p.rows_per_sample] : 1.f;
            float scaled[VEC];
#pragma unroll
            for (int i = 0; i < VEC; ++i) scaled[i] = scale * out[i];
            store_pack<TGrad, VEC>(static_cast<TGrad*>(p.dbranch) + row * cols + col, scaled);
          }
        }
      }
    }
  }
  if (!affine) return;
  if constexpr (kInRegisters) {
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      const int col = (c * 32 + lane) * VEC;
      if (col < cols) {
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          dw_slice[col + i] = dw_part[c][i];
          db_slice[col + i] = db_part[c][i];
        }
      }
    }
  }
  __syncthreads();
  float* out = p.workspace + static_cast<int64_t>(blockIdx.x) * 2 * cols;
  for (int i = threadIdx.x; i < 2 * cols; i += blockDim.x) {
    float total = 0.f;
#pragma unroll
    for (int w = 0; w < kBackwardWarps; ++w) total += partial[w * 2 * cols + i];
    out[i] = total;
  }
}

// Where the column sums of the [ctas, 2 * cols] partials go: dweight, then dbias.
struct NormGradients {
  float* dweight;
  float* dbias;
  int cols;
  __device__ void operator()(int i, float total) const {
    if (i < cols) {
      if (dweight) dweight[i] = total;
    } else if (dbias) {
      dbias[i - cols] = total;
    }
  }
};

// 4-wide accesses (16 bytes of fp32, 8 of bf16) where the row length and every pointer allow,
// else one element at a time (the general path, sized for the widest row).
int vector_width(int cols, std::initializer_list<std::pair<const void*, int>> pointers) {
  if (cols % 4 != 0) return 1;
  for (auto [ptr, elem_bytes] : pointers) {
    if (reinterpret_cast<uintptr_t>(ptr) % (4 * static_cast<uintptr_t>(elem_bytes)) != 0) return 1;
  }
  return 4;
}

int backward_ctas(int64_t rows) {
  return static_cast<int>(
      std::min<int64_t>((rows + kBackwardWarps - 1) / kBackwardWarps, kBackwardMaxCtas));
}

}  // namespace

cudaError_t layer_norm_forward(const LayerNormForwardArgs& a, cudaStream_t stream) {
  const bool residual = a.branch != nullptr;
  if (a.rows < 0 || a.cols <= 0 || a.cols > kLayerNormMaxColumns || !a.x || !a.y ||
      (a.mean == nullptr) != (a.rstd == nullptr) ||
      (a.rows + kForwardWarps - 1) / kForwardWarps > 0x7fffffff ||
      (residual && (!a.sum || a.in_dtype != DType::f32 || a.rows_per_sample <= 0))) {
    return cudaErrorInvalidValue;
  }
  if (a.rows == 0) return cudaSuccess;
  // One width for all: the narrowest that every pointer's alignment allows.
  const int out_bytes = dtype_bytes(a.out_dtype);
  const int vec =
      residual
          ? vector_width(a.cols, {{a.x, 4}, {a.y, out_bytes}, {a.branch, out_bytes}, {a.sum, 4}})
          : vector_width(a.cols, {{a.x, dtype_bytes(a.in_dtype)}, {a.y, out_bytes}});
  const dim3 grid(static_cast<unsigned>((a.rows + kForwardWarps - 1) / kForwardWarps));
  return with_element_type(a.in_dtype, [&](auto in_tag) {
    using TIn = decltype(in_tag);
    return with_element_type(a.out_dtype, [&](auto out_tag) {
      using TOut = decltype(out_tag);
      return with_row_chunks<kLayerNormMaxColumns>(vec, a.cols, [&](auto v, auto chunks) {
        constexpr int kVec = decltype(v)::value, kChunks = decltype(chunks)::value;
        if constexpr (std::is_same_v<TIn, float>) {
          if (residual) {
            forward_kernel<TIn, TOut, kVec, kChunks, true>
                <<<grid, kForwardWarps * 32, 0, stream>>>(a);
            return cudaGetLastError();
          }
        }
        forward_kernel<TIn, TOut, kVec, kChunks, false><<<grid, kForwardWarps * 32, 0, stream>>>(a);
        return cudaGetLastError();
      });
    });
  });
}

size_t layer_norm_backward_workspace_floats(int64_t rows, int cols) {
  return static_cast<size_t>(backward_ctas(rows)) * 2 * static_cast<size_t>(cols);
}

cudaError_t layer_norm_backward(const LayerNormBackwardArgs& a, cudaStream_t stream) {
  const bool affine = a.weight != nullptr;
  const bool residual = a.dsum != nullptr || a.dbranch != nullptr;
  if (a.rows < 0 || a.cols <= 0 || a.cols > kLayerNormMaxColumns || !a.x || !a.dy || !a.mean ||
      !a.rstd || !a.dx || (affine && !a.workspace) ||
      (residual && (a.in_dtype != DType::f32 || a.rows_per_sample <= 0))) {
    return cudaErrorInvalidValue;
  }
  if (a.rows == 0) {
    if (affine && a.dweight) cudaMemsetAsync(a.dweight, 0, sizeof(float) * a.cols, stream);
    if (affine && a.dbias) cudaMemsetAsync(a.dbias, 0, sizeof(float) * a.cols, stream);
    return cudaGetLastError();
  }
  const int in_bytes = dtype_bytes(a.in_dtype);
  const int grad_bytes = dtype_bytes(a.grad_dtype);
  int vec = vector_width(a.cols, {{a.x, in_bytes}, {a.dx, in_bytes}, {a.dy, grad_bytes}});
  if (a.dsum) vec = std::min(vec, vector_width(a.cols, {{a.dsum, 4}}));
  if (a.dbranch) vec = std::min(vec, vector_width(a.cols, {{a.dbranch, grad_bytes}}));
  const int ctas = backward_ctas(a.rows);
  const size_t shared = affine ? sizeof(float) * kBackwardWarps * 2 * a.cols : 0;
  cudaError_t err = with_element_type(a.in_dtype, [&](auto in_tag) {
    using TIn = decltype(in_tag);
    return with_element_type(a.grad_dtype, [&](auto grad_tag) {
      using TGrad = decltype(grad_tag);
      return with_row_chunks<kLayerNormMaxColumns>(vec, a.cols, [&](auto v, auto chunks) {
        constexpr int kVec = decltype(v)::value, kChunks = decltype(chunks)::value;
        if constexpr (std::is_same_v<TIn, float>) {
          if (residual) {
            backward_kernel<TIn, TGrad, kVec, kChunks, true>
                <<<ctas, kBackwardWarps * 32, shared, stream>>>(a);
            return cudaGetLastError();
          }
        }
        backward_kernel<TIn, TGrad, kVec, kChunks, false>
            <<<ctas, kBackwardWarps * 32, shared, stream>>>(a);
        return cudaGetLastError();
      });
    });
  });
  if (err != cudaSuccess || !affine) return err;
  return sum_partials(a.workspace, ctas, 2 * a.cols, NormGradients{a.dweight, a.dbias, a.cols},
                      stream);
}

}  // namespace mhla_kernels
