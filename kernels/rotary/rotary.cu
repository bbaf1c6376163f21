#include "rotary/rotary.h"

#include "common/element_type.cuh"

namespace mhla_kernels {
namespace {

// One thread per rotated pair; consecutive threads take consecutive i of one row, so loads and
// stores of a warp are contiguous runs.
template <typename T>
__global__ void rotary_kernel(const T* __restrict__ x, int64_t stride_b, int64_t stride_t,
                              int64_t stride_h, T* __restrict__ out,
                              const float* __restrict__ cos_table,
                              const float* __restrict__ sin_table, int tokens, int heads, int half,
                              int64_t pairs) {
  const int64_t index = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (index >= pairs) return;
  const int i = static_cast<int>(index % half);
  int64_t row = index / half;  // (b * tokens + t) * heads + h
  const int h = static_cast<int>(row % heads);
  const int64_t bt = row / heads;
  const int t = static_cast<int>(bt % tokens);
  const int64_t b = bt / tokens;
  const T* in = x + b * stride_b + t * stride_t + h * stride_h;
  T* o = out + row * (2 * static_cast<int64_t>(half));
  const float x1 = to_float(in[i]), x2 = to_float(in[i + half]);
  const float c = cos_table[static_cast<int64_t>(t) * half + i];
  const float s = sin_table[static_cast<int64_t>(t) * half + i];
  o[i] = from_float<T>(x1 * c - x2 * s);
  o[i + half] = from_float<T>(x2 * c + x1 * s);
}

template <typename T>
cudaError_t launch(const RotaryArgs& a, cudaStream_t stream) {
  const int half = a.head_dim / 2;
  const int64_t pairs = static_cast<int64_t>(a.batch) * a.tokens * a.heads * half;
  if (pairs == 0) return cudaSuccess;
  const int threads = 256;
  const int64_t blocks = (pairs + threads - 1) / threads;
  if (blocks > 0x7fffffffLL) return cudaErrorInvalidValue;
  rotary_kernel<T><<<static_cast<unsigned>(blocks), threads, 0, stream>>>(
      static_cast<const T*>(a.x.data), a.x.batch_stride, a.x.token_stride, a.x.head_stride,
      static_cast<T*>(a.out), a.cos, a.sin, a.tokens, a.heads, half, pairs);
  return cudaGetLastError();
}

}  // namespace

cudaError_t rotary_embedding(const RotaryArgs& args, cudaStream_t stream) {
  if (args.head_dim <= 0 || args.head_dim % 2 != 0 || !args.x.data || !args.out || !args.cos ||
      !args.sin) {
    return cudaErrorInvalidValue;
  }
  return with_element_type(args.dtype, [&](auto tag) {
    using T = decltype(tag);
    return launch<T>(args, stream);
  });
}

}  // namespace mhla_kernels
