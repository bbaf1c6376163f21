#pragma once
// Rotary position embedding (half-split form): for x [B, T, H, D] and positions t,
// x' = [x1 cos - x2 sin, x2 cos + x1 sin] with x1, x2 the two halves of D and angles
// t * base^(-2i / D), computed in fp32 and returned in x's dtype.
#include <array>

#include <torch/torch.h>

namespace mhla {

// On CUDA (bf16, fp16, fp32) one fused kernel per direction (kernels/rotary): reads x once,
// writes the result once; elsewhere the plain-LibTorch form below.
torch::Tensor apply_rotary(const torch::Tensor& x, int64_t first_position = 0, double base = 10000.0);
// The plain-LibTorch form on any device: the kernel's test oracle.
torch::Tensor apply_rotary_reference(const torch::Tensor& x, int64_t first_position = 0,
                                     double base = 10000.0);

// The attention layer's form: the fused projection qkv [B, T, 3, H, D] -> (rotated q, rotated k,
// v), each [B, T, H, D]. On CUDA one kernel launch each way (the backward writes the projection's
// gradient directly); elsewhere unbind + the reference rotation (v a view).
std::array<torch::Tensor, 3> split_rotary_qkv(const torch::Tensor& qkv, int64_t first_position = 0,
                                              double base = 10000.0);

}  // namespace mhla
