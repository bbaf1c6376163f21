#pragma once
// One-token decoding step of the gated delta rule for the layers: where
// delta_rule_decode_uses_kernel says so, the kernel of kernels/gated_delta/decode.cu updates the
// state in place; elsewhere the reference step (delta_rule_step, the kernel's test oracle). Same
// arguments and result as delta_rule_step.
#include <torch/torch.h>

namespace mhla {

// Whether delta_rule_decode runs the kernel for these arguments: CUDA build, everything on the
// state's GPU, fp32 state [B, H, Dk, Dv] with Dk <= 256, q/k/v of one float dtype, beta [B, H],
// g [B, H] or [B, H, Dk], and no gradient wanted (the kernel works outside autograd).
bool delta_rule_decode_uses_kernel(const torch::Tensor& state, const torch::Tensor& q,
                                   const torch::Tensor& k, const torch::Tensor& v,
                                   const torch::Tensor& beta, const torch::Tensor& g);

torch::Tensor delta_rule_decode(torch::Tensor& state, const torch::Tensor& q, const torch::Tensor& k,
                                const torch::Tensor& v, const torch::Tensor& beta,
                                const torch::Tensor& g, double scale);

}  // namespace mhla
