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

// bf16 -> fp32 is exact bit placement: one integer instruction, which the compiler can merge
// with the extraction of the half from a packed word (cvt.f32.bf16 took one more).
template <typename T>
__device__ __forceinline__ float to_float(T x) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __uint_as_float(static_cast<unsigned>(__bfloat16_as_ushort(x)) << 16);
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

// Two adjacent 16-bit elements (one 32-bit word, the first in the low half) <-> fp32. For bf16
// the widening is bit placement, one integer instruction per element, and the narrowing rounds
// both values in one cvt.rn.bf16x2 (the same rounding as one at a time); fp16 likewise in pairs.
// The row forms and feature backwards of the token passes convert every element of a tile at
// least twice: in the query pass these conversions were 12 % of the instructions (session 29).
template <typename T>
__device__ __forceinline__ void unpack_pair(unsigned bits, float& a, float& b) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    a = __uint_as_float(bits << 16);
    b = __uint_as_float(bits & 0xffff0000u);
  } else {
    const T* e = reinterpret_cast<const T*>(&bits);
    a = to_float(e[0]);
    b = to_float(e[1]);
  }
}

template <typename T>
__device__ __forceinline__ unsigned pack_pair(float a, float b) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const __nv_bfloat162 pair = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<const unsigned*>(&pair);
  } else if constexpr (std::is_same_v<T, __half>) {
    const __half2 pair = __floats2half2_rn(a, b);
    return *reinterpret_cast<const unsigned*>(&pair);
  } else {
    unsigned bits;
    T* e = reinterpret_cast<T*>(&bits);
    e[0] = from_float<T>(a);
    e[1] = from_float<T>(b);
    return bits;
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
