#pragma once
// The residual update of a pre-norm block, out = x + scale[sample] * branch, with x and out in
// fp32 (the residual stream under autocast) and the branch in bf16/fp16/fp32. ATen takes a slow
// non-vectorized path for an fp32 + bf16 add, and stochastic depth adds a second pass for the
// per-sample scale; this is one vectorized pass. The backward's branch gradient,
// dbranch = scale[sample] * dout cast to the branch dtype, is a second entry point.
#include <cstdint>

#include <cuda_runtime.h>

#include "mhla/block_linear_attention.h"  // DType

namespace mhla_kernels {

struct ResidualAddArgs {
  DType branch_dtype = DType::bf16;
  int64_t numel = 0;
  int64_t per_sample = 0;        // elements per sample (numel / batch); used with scale
  const float* x = nullptr;      // [numel] fp32
  const void* branch = nullptr;  // [numel]
  const float* scale = nullptr;  // [numel / per_sample] or null (1)
  float* out = nullptr;          // [numel] fp32 (may alias x)
};

cudaError_t residual_add(const ResidualAddArgs& args, cudaStream_t stream);

struct ScaledCastArgs {
  DType out_dtype = DType::bf16;
  int64_t numel = 0;
  int64_t per_sample = 0;
  const float* grad = nullptr;   // [numel] fp32
  const float* scale = nullptr;  // or null
  void* out = nullptr;           // [numel] in out_dtype
};

cudaError_t scaled_cast(const ScaledCastArgs& args, cudaStream_t stream);

}  // namespace mhla_kernels
