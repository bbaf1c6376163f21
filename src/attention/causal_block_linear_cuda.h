#pragma once
// The `cuda` backend of causal linear attention and causal MHLA (language models): an autograd
// function around kernels/mhla/causal_block_linear (64-token blocks, forward and backward,
// gradients for q, k, v and the learned mixing matrix). Shapes and dtypes the kernels do not take
// (fp32 with D = 128, D outside {32, 64, 128}, more than 64 trained blocks) run the reference.
// Built only where the CUDA kernels are (MHLA_WITH_CUDA_KERNELS).
#include <torch/torch.h>

namespace mhla {

// q, k, v [B, T, H, D] on one CUDA device; mixing: the learned lower-triangular M x M matrix
// (MHLA) or an undefined tensor (linear attention).
torch::Tensor causal_block_linear_cuda(const torch::Tensor& q, const torch::Tensor& k,
                                       const torch::Tensor& v, const torch::Tensor& mixing);

}  // namespace mhla
