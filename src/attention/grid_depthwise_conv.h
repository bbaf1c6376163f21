#pragma once
// The CPE of the attention layers (attention.cpe): a depthwise k x k convolution (zero padding
// k / 2, with bias) over the 2-D patch grid of tokens stored in a TokenLayout's block-major order.
// On CUDA, for k = 3, one kernel each way (kernels/grid_conv/grid_depthwise_conv.h: it reads the
// tokens where they lie); MHLA_FUSED_GRID_CONV=0, CPUs and other kernel sizes take the reference,
// which gathers the tokens into a raster grid, runs ATen's conv2d and gathers them back.
#include <torch/torch.h>

#include "attention/token_layout.h"

namespace mhla {

// x [B, N, C] in the layout's token order (rows of C contiguous elements: a strided view such
// as v of a fused q/k/v projection is read in place where it is 16-byte aligned); weight
// [C, 1, k, k] and bias [C] (or undefined), as torch::nn::Conv2d keeps them. Returns [B, N, C]
// in the same token order, in x's dtype on the kernel path (the reference follows autocast).
torch::Tensor grid_depthwise_conv(const torch::Tensor& x, const torch::Tensor& weight,
                                  const torch::Tensor& bias, const TokenLayout& layout);

// base + grid_depthwise_conv(x, ...) in base's dtype: the CPE added to the attention output. On
// the kernel path, when base has x's dtype and shape and is contiguous, the kernel adds it in its
// one pass (no separate add over the activation), and the base's gradient is the output's.
torch::Tensor grid_depthwise_conv_added(const torch::Tensor& base, const torch::Tensor& x,
                                        const torch::Tensor& weight, const torch::Tensor& bias,
                                        const TokenLayout& layout);

// The ATen form: the tests' reference and the path the kernel does not take.
torch::Tensor grid_depthwise_conv_reference(const torch::Tensor& x, const torch::Tensor& weight,
                                            const torch::Tensor& bias, const TokenLayout& layout);

// The kernel form, plus base ([B, N, C], or undefined) when given, in x's dtype; fails, saying what
// it needs, for inputs it does not take.
torch::Tensor grid_depthwise_conv_kernel(const torch::Tensor& x, const torch::Tensor& weight,
                                         const torch::Tensor& bias, const TokenLayout& layout,
                                         const torch::Tensor& base = {});

}  // namespace mhla
