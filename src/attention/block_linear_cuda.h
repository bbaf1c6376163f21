#pragma once
// The `cuda` backend of linear attention and MHLA: autograd functions around the fused kernels in
// kernels/linear_attn and kernels/mhla (forward and backward, gradients for q, k, v and the mixing
// matrix). Bidirectional ops run here; causal ones go to causal_block_linear_cuda.h. Built only
// where the CUDA kernels are (MHLA_WITH_CUDA_KERNELS).
#include "attention/attention_op.h"

namespace mhla {

torch::Tensor linear_attention_cuda(const torch::Tensor& q, const torch::Tensor& k,
                                    const torch::Tensor& v, const OpArgs& args);
torch::Tensor mhla_cuda(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                        const OpArgs& args);

// The `cuda_dense` backend: the dense masked form (kernels/mhla/dense_block_linear.h), O(N^2 D)
// without block states, for short sequences. Bidirectional shapes it does not take run the state
// kernels; causal (64-token blocks, up to 64 of them) runs the same kernels with a causal mask,
// longer sequences the reference. Not chosen by `auto` until it has been checked and timed on
// the GPU.
torch::Tensor linear_attention_cuda_dense(const torch::Tensor& q, const torch::Tensor& k,
                                          const torch::Tensor& v, const OpArgs& args);
torch::Tensor mhla_cuda_dense(const torch::Tensor& q, const torch::Tensor& k,
                              const torch::Tensor& v, const OpArgs& args);

}  // namespace mhla
