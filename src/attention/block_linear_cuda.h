#pragma once
// The `cuda` backend of linear attention and MHLA: autograd functions around the fused kernels in
// kernels/linear_attn and kernels/mhla (forward and backward, gradients for q, k, v and the mixing
// matrix). Bidirectional ops run here; causal ones go to causal_block_linear_cuda.h. Built only
// where the CUDA kernels are (MHLA_WITH_CUDA_KERNELS).
#include <string>

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

// The bidirectional kernel families of the `cuda` backend, by name: "resident" (the whole
// sequence of a (batch, head) in one CTA, dense form), "cluster" (one 16-CTA cluster per
// (batch, head)) and "states" (block states through global memory; "states-passes" and
// "states-sequence" ask for its forward as three passes or as one kernel,
// kernels/mhla/sequence_state_forward.h); "resident-warpgroup",
// "resident-state" and "resident-scores" are the resident family with one backward form asked
// for (kernels/mhla/resident_block_linear.h). The backend takes the resident kernels where they
// fit and the state kernels otherwise; MHLA_BIDIRECTIONAL_KERNEL=cluster / states moves one
// family first (the cluster kernels are slower than the state kernels: block_linear_cuda.cpp
// says by how much). For tests and A/B runs:
// whether `family` takes the inputs, and the op run by it (an error if it does not take them).
// mixing: [blocks, blocks] fp32, or an empty tensor for linear attention (blocks = 1).
bool block_linear_family_takes(const std::string& family, const torch::Tensor& q,
                               const torch::Tensor& v, int64_t blocks);
torch::Tensor block_linear_by_named_family(const std::string& family, const torch::Tensor& q,
                                           const torch::Tensor& k, const torch::Tensor& v,
                                           const torch::Tensor& mixing, int64_t blocks);

}  // namespace mhla
