#pragma once
// The element types the kernels take (float, __half, __nv_bfloat16): with_element_type(dtype, f)
// calls f(T{}) for a runtime DType (for launchers); to_float / from_float<T> convert one value
// (round to nearest) for the kernels' fp32 arithmetic.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <type_traits>

#include "mhla/block_linear_attention.h"  // DType

namespace mhla_kernels {

template <typename T>
__device__ __forceinline__ float to_float(T x) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __bfloat162float(x);
  } else if constexpr (std::is_same_v<T, __half>) {
    return __half2float(x);
  } else {
    return x;
  }
}

template <typename T>
__device__ __forceinline__ T from_float(float x) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __float2bfloat16_rn(x);
  } else if constexpr (std::is_same_v<T, __half>) {
    return __float2half_rn(x);
  } else {
    return x;
  }
}

template <typename F>
cudaError_t with_element_type(DType dtype, F&& f) {
  switch (dtype) {
    case DType::f32:
      return f(float{});
    case DType::f16:
      return f(__half{});
    case DType::bf16:
      return f(__nv_bfloat16{});
  }
  return cudaErrorInvalidValue;
}

}  // namespace mhla_kernels
