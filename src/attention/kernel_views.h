#pragma once
// What the attention bindings share around a kernel launch (builds with the CUDA kernels only):
// the kernels' dtype for a tensor, [B, N, H, D] views the kernels can read in 16-byte vectors, a
// launch check that names the op, and the input dtypes an autograd function sends its gradients
// back in (the kernels compute in v's dtype; q and k may arrive in another under autocast).
#ifdef MHLA_WITH_CUDA_KERNELS
#include <initializer_list>
#include <string>
#include <utility>

#include <cuda_runtime.h>
#include <torch/torch.h>

#include "mhla/block_linear_attention.h"

namespace mhla {

mhla_kernels::DType kernel_dtype(torch::ScalarType type);

// t in `dtype` with its last dimension contiguous and every row 16-byte aligned (a copy only when
// needed: the q/k/v slices of the fused projection qualify as they are).
torch::Tensor readable(const torch::Tensor& t, torch::ScalarType dtype);

mhla_kernels::TokenTensor view_of(const torch::Tensor& t);

void check_launch(cudaError_t err, const char* what);

// Fails, naming the op and the tensor, unless every defined tensor is on q's device (a kernel
// handed a pointer from another device or from the host reads garbage or faults).
void check_same_device(const std::string& op, const torch::Tensor& q,
                       std::initializer_list<std::pair<const char*, torch::Tensor>> others);

void remember_input_dtypes(torch::autograd::AutogradContext* ctx, const torch::Tensor& q,
                           const torch::Tensor& k);
std::pair<torch::ScalarType, torch::ScalarType> input_dtypes(torch::autograd::AutogradContext* ctx);

}  // namespace mhla
#endif
