#include "rotary/rotary.h"

#include "common/packed_access.cuh"

namespace mhla_kernels {
namespace {

// One thread per VEC adjacent pairs of one (b, t, h) row, for every part: consecutive threads
// take consecutive pair groups of a row, so a warp's loads and stores are contiguous runs.
template <typename T, int VEC>
__global__ void rotary_kernel(RotaryArgs a, int64_t items) {
  const int64_t index = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (index >= items) return;
  const int half = a.head_dim / 2, groups = half / VEC;
  const int i0 = static_cast<int>(index % groups) * VEC;
  const int64_t row = index / groups;  // (b * tokens + t) * heads + h
  const int h = static_cast<int>(row % a.heads);
  const int64_t bt = row / a.heads;
  const int t = static_cast<int>(bt % a.tokens);
  const int64_t b = bt / a.tokens;
  const int64_t angle = static_cast<int64_t>(t) * half + i0;
  float c[VEC], s[VEC];
#pragma unroll
  for (int i = 0; i < VEC; ++i) c[i] = a.cos[angle + i], s[i] = a.sin_sign * a.sin[angle + i];
#pragma unroll
  for (int p = 0; p < 3; ++p) {
    if (p >= a.parts) break;
    const T* in = static_cast<const T*>(a.in[p].data) + b * a.in[p].batch_stride +
                  t * a.in[p].token_stride + h * a.in[p].head_stride;
    T* out = static_cast<T*>(a.out[p].data) + b * a.out[p].batch_stride +
             t * a.out[p].token_stride + h * a.out[p].head_stride;
    const auto x1 = *reinterpret_cast<const Pack<T, VEC>*>(in + i0);
    const auto x2 = *reinterpret_cast<const Pack<T, VEC>*>(in + half + i0);
    if (p < a.rotated) {
      Pack<T, VEC> y1, y2;
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        const float u = to_float(x1.v[i]), w = to_float(x2.v[i]);
        y1.v[i] = from_float<T>(u * c[i] - w * s[i]);
        y2.v[i] = from_float<T>(w * c[i] + u * s[i]);
      }
      *reinterpret_cast<Pack<T, VEC>*>(out + i0) = y1;
      *reinterpret_cast<Pack<T, VEC>*>(out + half + i0) = y2;
    } else {
      *reinterpret_cast<Pack<T, VEC>*>(out + i0) = x1;
      *reinterpret_cast<Pack<T, VEC>*>(out + half + i0) = x2;
    }
  }
}

// 16-byte accesses when every view's rows, strides and the half dimension allow it.
template <typename T>
bool vector_path(const RotaryArgs& a, int vec) {
  const int half = a.head_dim / 2;
  if (half % vec != 0) return false;
  const auto fits = [&](const void* p, int64_t sb, int64_t st, int64_t sh) {
    return reinterpret_cast<uintptr_t>(p) % (sizeof(T) * vec) == 0 && sb % vec == 0 &&
           st % vec == 0 && sh % vec == 0;
  };
  for (int p = 0; p < a.parts; ++p) {
    if (!fits(a.in[p].data, a.in[p].batch_stride, a.in[p].token_stride, a.in[p].head_stride) ||
        !fits(a.out[p].data, a.out[p].batch_stride, a.out[p].token_stride, a.out[p].head_stride)) {
      return false;
    }
  }
  return true;
}

template <typename T, int VEC>
cudaError_t launch_with(const RotaryArgs& a, cudaStream_t stream) {
  const int64_t items = static_cast<int64_t>(a.batch) * a.tokens * a.heads * (a.head_dim / 2 / VEC);
  const int threads = 256;
  const int64_t blocks = (items + threads - 1) / threads;
  if (blocks > 0x7fffffffLL) return cudaErrorInvalidValue;
  rotary_kernel<T, VEC><<<static_cast<unsigned>(blocks), threads, 0, stream>>>(a, items);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch(const RotaryArgs& a, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  if (vector_path<T>(a, kVec)) return launch_with<T, kVec>(a, stream);
  return launch_with<T, 1>(a, stream);
}

}  // namespace

cudaError_t rotary_embedding(const RotaryArgs& args, cudaStream_t stream) {
  if (args.head_dim <= 0 || args.head_dim % 2 != 0 || args.parts < 1 || args.parts > 3 ||
      args.rotated < 0 || args.rotated > args.parts || !args.cos || !args.sin) {
    return cudaErrorInvalidValue;
  }
  for (int p = 0; p < args.parts; ++p) {
    if (!args.in[p].data || !args.out[p].data) return cudaErrorInvalidValue;
  }
  if (static_cast<int64_t>(args.batch) * args.tokens * args.heads == 0) return cudaSuccess;
  return with_element_type(args.dtype, [&](auto tag) {
    using T = decltype(tag);
    return launch<T>(args, stream);
  });
}

}  // namespace mhla_kernels
