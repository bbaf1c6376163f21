#pragma once
// Causal MHLA's output stage: RMSNorm over each head's vector times a swish gate,
//   y = rms_norm(x, weight, eps) * silu(gate),   x and gate [..., D], weight [D] (fp32).
// The reference is ATen's rms_norm, silu and a multiply (the CPU path). On CUDA by default
// (MHLA_FUSED_GATED_NORM=0 for the reference): kernels/gated_rms_norm, one pass each way, output
// in x's dtype (bf16 under autocast, where ATen's product comes out in fp32 and is cast by the
// next matmul). GPT MHLA: 512,623 -> 586,918 tok/s on the H200 (session 7).
#include <torch/torch.h>

namespace mhla {

torch::Tensor gated_rms_norm(const torch::Tensor& x, const torch::Tensor& gate,
                             const torch::Tensor& weight, double eps);

// The ATen form (the tests' reference and the default path).
torch::Tensor gated_rms_norm_reference(const torch::Tensor& x, const torch::Tensor& gate,
                                       const torch::Tensor& weight, double eps);

// The kernel form: x and gate on CUDA in one of fp32/bf16/fp16, D in {32, 64, 128, 256}.
torch::Tensor gated_rms_norm_kernel(const torch::Tensor& x, const torch::Tensor& gate,
                                    const torch::Tensor& weight, double eps);

}  // namespace mhla
