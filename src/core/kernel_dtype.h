#pragma once
// The kernels' runtime element type for a torch dtype (builds with the CUDA kernels only).
#ifdef MHLA_WITH_CUDA_KERNELS
#include <optional>

#include <torch/torch.h>

#include "mhla/block_linear_attention.h"  // mhla_kernels::DType

namespace mhla {

// nullopt for the dtypes the kernels do not take (fp64, integers).
inline std::optional<mhla_kernels::DType> kernel_dtype_of(torch::ScalarType type) {
  switch (type) {
    case torch::kFloat32:
      return mhla_kernels::DType::f32;
    case torch::kFloat16:
      return mhla_kernels::DType::f16;
    case torch::kBFloat16:
      return mhla_kernels::DType::bf16;
    default:
      return std::nullopt;
  }
}

}  // namespace mhla
#endif
