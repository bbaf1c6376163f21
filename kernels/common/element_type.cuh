#pragma once
// The element type behind a runtime DType, for launchers: with_element_type(dtype, f) calls
// f(T{}) with T = float, __half or __nv_bfloat16 and returns its result.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "mhla/block_linear_attention.h"  // DType

namespace mhla_kernels {

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
