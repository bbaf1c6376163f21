#pragma once
// The gated delta layers' input stage: a depthwise causal conv (width 4) over time on the fused
// q/k/v projection, SiLU, and L2-normalized q and k per head (kernels/short_conv/short_conv.h has
// the formulas). On CUDA by default (MHLA_FUSED_SHORT_CONV=0 for the reference): one kernel each
// way, in place of ATen's transposes, pad, conv, SiLU and strided normalizations.
#include <array>

#include <torch/torch.h>

namespace mhla {

// qkv [B, T, 3 H D] (q, k, v parts of H heads of D), weight [3 H D, 1, W] (the Conv1d's);
// reversed reads the sequence back to front and returns q, k, v in that order. Returns q, k, v as
// [B, T, H, D], q and k L2-normalized (eps 1e-6).
std::array<torch::Tensor, 3> short_conv_qkv(const torch::Tensor& qkv, const torch::Tensor& weight,
                                            int64_t heads, bool reversed);

// The ATen form: the tests' reference and the path for CPUs and shapes the kernel does not take.
std::array<torch::Tensor, 3> short_conv_qkv_reference(const torch::Tensor& qkv,
                                                      const torch::Tensor& weight, int64_t heads,
                                                      bool reversed);

// The kernel form: qkv on CUDA in fp32/bf16/fp16, fp32 weight of width 4, D in {32, 64, 128}.
std::array<torch::Tensor, 3> short_conv_qkv_kernel(const torch::Tensor& qkv,
                                                   const torch::Tensor& weight, int64_t heads,
                                                   bool reversed);

// The activations after the conv, shared with decoding: conv output [B, T, 3 H D] -> q, k
// (SiLU, L2-normalized per head), v (SiLU), each [B, T, H, D].
std::array<torch::Tensor, 3> activate_conv_qkv(const torch::Tensor& conv_out, int64_t heads);

}  // namespace mhla
