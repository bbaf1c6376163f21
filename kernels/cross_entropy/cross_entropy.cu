#include "cross_entropy/cross_entropy.h"

#include <cmath>
#include <cstdint>

#include "common/packed_access.cuh"

namespace mhla_kernels {
namespace {

// Running (max, sum of exp(x - max)) of a set of values; merges are exact up to rounding.
struct SoftmaxSum {
  float max = -INFINITY, sum = 0.f;
  __device__ void add(float x) {
    if (x == -INFINITY) return;  // exp(-inf) adds nothing (and -inf - -inf would be NaN)
    if (x > max) {
      sum = sum * __expf(max - x) + 1.f;
      max = x;
    } else {
      sum += __expf(x - max);
    }
  }
  __device__ void merge(float other_max, float other_sum) {
    if (other_max == -INFINITY) return;
    if (other_max > max) {
      sum = sum * __expf(max - other_max) + other_sum;
      max = other_max;
    } else {
      sum += other_sum * __expf(other_max - max);
    }
  }
};

constexpr int kMaxWarps = 8;

template <typename T, int VEC>
__global__ void __launch_bounds__(kMaxWarps * 32) forward_kernel(CrossEntropyArgs a) {
  __shared__ float shared_max[kMaxWarps], shared_sum[kMaxWarps], shared_total[kMaxWarps];
  const int64_t row = blockIdx.x;
  const T* x = static_cast<const T*>(a.logits) + row * a.row_stride;
  SoftmaxSum acc;
  float total = 0.f;  // sum of the row, for label smoothing
  for (int j = threadIdx.x * VEC; j < a.classes; j += blockDim.x * VEC) {
    const auto pack = *reinterpret_cast<const Pack<T, VEC>*>(x + j);
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      const float value = to_float(pack.v[i]);
      acc.add(value);
      total += value;
    }
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    const float other_max = __shfl_xor_sync(0xffffffffu, acc.max, offset);
    const float other_sum = __shfl_xor_sync(0xffffffffu, acc.sum, offset);
    acc.merge(other_max, other_sum);
    total += __shfl_xor_sync(0xffffffffu, total, offset);
  }
  const int warp = threadIdx.x / 32, warps = blockDim.x / 32;
  if (threadIdx.x % 32 == 0) {
    shared_max[warp] = acc.max, shared_sum[warp] = acc.sum, shared_total[warp] = total;
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  SoftmaxSum row_acc;
  float row_total = 0.f;
  for (int w = 0; w < warps; ++w) {  // fixed order: deterministic
    row_acc.merge(shared_max[w], shared_sum[w]);
    row_total += shared_total[w];
  }
  const float lse = row_acc.max + logf(row_acc.sum);
  const int64_t target = a.targets[row];
  float loss = NAN;
  if (target >= 0 && target < a.classes) {
    const float eps = a.label_smoothing;
    loss = lse - (1.f - eps) * to_float(x[target]);
    // Only with smoothing: 0 * (-inf) would turn a row with masked (-inf) logits into NaN.
    if (eps > 0.f) loss -= eps * row_total / a.classes;
  }
  a.loss[row] = loss;
  a.lse[row] = lse;
}

template <typename T, int VEC>
__global__ void __launch_bounds__(kMaxWarps * 32) backward_kernel(CrossEntropyArgs a) {
  const int64_t row = blockIdx.x;
  const T* x = static_cast<const T*>(a.logits) + row * a.row_stride;
  T* dx = static_cast<T*>(a.grad_logits) + row * static_cast<int64_t>(a.classes);
  const int64_t target = a.targets[row];
  const bool valid = target >= 0 && target < a.classes;
  const float g = valid ? a.grad_loss[row] : NAN;
  const float lse = a.lse[row];
  const float eps = a.label_smoothing;
  const float smooth = eps / a.classes, hit = 1.f - eps;
  for (int j = threadIdx.x * VEC; j < a.classes; j += blockDim.x * VEC) {
    const auto pack = *reinterpret_cast<const Pack<T, VEC>*>(x + j);
    Pack<T, VEC> out;
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      const float p = __expf(to_float(pack.v[i]) - lse);
      const float d = p - smooth - (j + i == target ? hit : 0.f);
      out.v[i] = from_float<T>(g * d);
    }
    *reinterpret_cast<Pack<T, VEC>*>(dx + j) = out;
  }
}

int threads_for(int classes, int vec) {
  const int per_thread_steps = (classes + vec - 1) / vec;
  int threads = 32;
  while (threads < kMaxWarps * 32 && threads < per_thread_steps) threads *= 2;
  return threads;
}

template <typename T, template <typename, int> class Kernel>
cudaError_t launch(const CrossEntropyArgs& a, bool backward, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  const auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  const bool vector = a.classes % kVec == 0 && a.row_stride % kVec == 0 && aligned(a.logits) &&
                      (!backward || aligned(a.grad_logits));
  const int vec = vector ? kVec : 1;
  const int threads = threads_for(a.classes, vec);
  if (a.rows > 0x7fffffffLL) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(a.rows));
  if (vector) {
    Kernel<T, kVec>::launch(grid, threads, stream, a);
  } else {
    Kernel<T, 1>::launch(grid, threads, stream, a);
  }
  return cudaGetLastError();
}

template <typename T, int VEC>
struct Forward {
  static void launch(dim3 grid, int threads, cudaStream_t stream, const CrossEntropyArgs& a) {
    forward_kernel<T, VEC><<<grid, threads, 0, stream>>>(a);
  }
};

template <typename T, int VEC>
struct Backward {
  static void launch(dim3 grid, int threads, cudaStream_t stream, const CrossEntropyArgs& a) {
    backward_kernel<T, VEC><<<grid, threads, 0, stream>>>(a);
  }
};

bool valid_common(const CrossEntropyArgs& a) {
  return a.rows >= 0 && a.classes > 0 && a.row_stride >= a.classes && a.logits && a.targets &&
         a.lse && a.label_smoothing >= 0.f && a.label_smoothing <= 1.f;
}

}  // namespace

cudaError_t cross_entropy_forward(const CrossEntropyArgs& args, cudaStream_t stream) {
  if (!valid_common(args) || !args.loss) return cudaErrorInvalidValue;
  if (args.rows == 0) return cudaSuccess;
  return with_element_type(
      args.dtype, [&](auto tag) { return launch<decltype(tag), Forward>(args, false, stream); });
}

cudaError_t cross_entropy_backward(const CrossEntropyArgs& args, cudaStream_t stream) {
  if (!valid_common(args) || !args.grad_loss || !args.grad_logits) return cudaErrorInvalidValue;
  if (args.rows == 0) return cudaSuccess;
  return with_element_type(
      args.dtype, [&](auto tag) { return launch<decltype(tag), Backward>(args, true, stream); });
}

}  // namespace mhla_kernels
