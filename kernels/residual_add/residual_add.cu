#include "residual_add/residual_add.h"

#include <algorithm>

#include "common/element_type.cuh"

namespace mhla_kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kVec = 4;

template <typename T>
struct alignas(sizeof(T) * kVec) Pack {
  T v[kVec];
};

__device__ __forceinline__ float sample_scale(const float* scale, int64_t i, int64_t per_sample) {
  return scale ? scale[i / per_sample] : 1.f;
}

// VECTOR: kVec elements per access (numel and per_sample multiples of kVec, aligned pointers),
// so one pack never straddles two samples.
template <typename T, bool VECTOR>
__global__ void __launch_bounds__(kThreads) add_kernel(ResidualAddArgs p) {
  const T* branch = static_cast<const T*>(p.branch);
  const int64_t step = static_cast<int64_t>(gridDim.x) * kThreads;
  if constexpr (VECTOR) {
    const int64_t packs = p.numel / kVec;
    for (int64_t j = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; j < packs;
         j += step) {
      const float s = sample_scale(p.scale, j * kVec, p.per_sample);
      const float4 xv = reinterpret_cast<const float4*>(p.x)[j];
      const Pack<T> bv = reinterpret_cast<const Pack<T>*>(branch)[j];
      float4 out;
      out.x = xv.x + s * to_float(bv.v[0]);
      out.y = xv.y + s * to_float(bv.v[1]);
      out.z = xv.z + s * to_float(bv.v[2]);
      out.w = xv.w + s * to_float(bv.v[3]);
      reinterpret_cast<float4*>(p.out)[j] = out;
    }
  } else {
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < p.numel;
         i += step) {
      p.out[i] = p.x[i] + sample_scale(p.scale, i, p.per_sample) * to_float(branch[i]);
    }
  }
}

template <typename T, bool VECTOR>
__global__ void __launch_bounds__(kThreads) cast_kernel(ScaledCastArgs p) {
  T* out = static_cast<T*>(p.out);
  const int64_t step = static_cast<int64_t>(gridDim.x) * kThreads;
  if constexpr (VECTOR) {
    const int64_t packs = p.numel / kVec;
    for (int64_t j = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; j < packs;
         j += step) {
      const float s = sample_scale(p.scale, j * kVec, p.per_sample);
      const float4 g = reinterpret_cast<const float4*>(p.grad)[j];
      Pack<T> o;
      o.v[0] = from_float<T>(s * g.x);
      o.v[1] = from_float<T>(s * g.y);
      o.v[2] = from_float<T>(s * g.z);
      o.v[3] = from_float<T>(s * g.w);
      reinterpret_cast<Pack<T>*>(out)[j] = o;
    }
  } else {
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < p.numel;
         i += step) {
      out[i] = from_float<T>(sample_scale(p.scale, i, p.per_sample) * p.grad[i]);
    }
  }
}

bool aligned(const void* p, int bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

unsigned grid_for(int64_t work) {
  return static_cast<unsigned>(std::clamp<int64_t>((work + kThreads - 1) / kThreads, 1, 132 * 32));
}

}  // namespace

cudaError_t residual_add(const ResidualAddArgs& a, cudaStream_t stream) {
  if (a.numel < 0 || !a.x || !a.branch || !a.out || (a.scale && a.per_sample <= 0)) {
    return cudaErrorInvalidValue;
  }
  if (a.numel == 0) return cudaSuccess;
  return with_element_type(a.branch_dtype, [&](auto tag) {
    using T = decltype(tag);
    const bool vector = a.numel % kVec == 0 && (!a.scale || a.per_sample % kVec == 0) &&
                        aligned(a.x, 16) && aligned(a.out, 16) &&
                        aligned(a.branch, sizeof(T) * kVec);
    if (vector) {
      add_kernel<T, true><<<grid_for(a.numel / kVec), kThreads, 0, stream>>>(a);
    } else {
      add_kernel<T, false><<<grid_for(a.numel), kThreads, 0, stream>>>(a);
    }
    return cudaGetLastError();
  });
}

cudaError_t scaled_cast(const ScaledCastArgs& a, cudaStream_t stream) {
  if (a.numel < 0 || !a.grad || !a.out || (a.scale && a.per_sample <= 0)) {
    return cudaErrorInvalidValue;
  }
  if (a.numel == 0) return cudaSuccess;
  return with_element_type(a.out_dtype, [&](auto tag) {
    using T = decltype(tag);
    const bool vector = a.numel % kVec == 0 && (!a.scale || a.per_sample % kVec == 0) &&
                        aligned(a.grad, 16) && aligned(a.out, sizeof(T) * kVec);
    if (vector) {
      cast_kernel<T, true><<<grid_for(a.numel / kVec), kThreads, 0, stream>>>(a);
    } else {
      cast_kernel<T, false><<<grid_for(a.numel), kThreads, 0, stream>>>(a);
    }
    return cudaGetLastError();
  });
}

}  // namespace mhla_kernels
