#pragma once
// The `cuda` backend of bidirectional linear attention and MHLA: autograd functions around the
// fused kernels in kernels/linear_attn and kernels/mhla (forward and backward, gradients for q, k,
// v and the mixing matrix). Built only where the CUDA kernels are (MHLA_WITH_CUDA_KERNELS).
#include "attention/attention_op.h"

namespace mhla {

torch::Tensor linear_attention_cuda(const torch::Tensor& q, const torch::Tensor& k,
                                    const torch::Tensor& v, const OpArgs& args);
torch::Tensor mhla_cuda(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                        const OpArgs& args);

}  // namespace mhla
