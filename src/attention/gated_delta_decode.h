#pragma once
// One-token decoding step of the gated delta rule for the layers: on a GPU (fp32 state, head dims
// up to 256, bf16/fp16/fp32 tokens) the kernel of kernels/gated_delta/decode.cu updates the state
// in place; elsewhere the reference step (delta_rule_step, the kernel's test oracle). Same
// arguments and result as delta_rule_step.
#include <torch/torch.h>

namespace mhla {

torch::Tensor delta_rule_decode(torch::Tensor& state, const torch::Tensor& q, const torch::Tensor& k,
                                const torch::Tensor& v, const torch::Tensor& beta,
                                const torch::Tensor& g, double scale);

}  // namespace mhla
