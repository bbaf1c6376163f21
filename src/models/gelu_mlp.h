#pragma once
// The transformer MLP fc2(gelu(fc1(x))) with both GELU forms, and on CUDA, for the tanh form, the
// activation fused into the matrix products (kernels/gemm_epilogue): the forward's fc1 product
// writes gelu(pre) and pre, the backward's dy W2 product writes d_pre = (dy W2) gelu'(pre); fc1's
// bias gradient is the fp32 column sum of d_pre. The unfused path's separate GELU forward and
// backward passes over the hidden activation go away.
// The exact (erf) form has no such epilogue: its forward is torch's product and GELU, and in
// training its backward forms d_pre and fc1's bias gradient in one pass (kernels/column_sum),
// where torch's GELU backward writes d_pre and the bias gradient reads it again.
// MHLA_FUSED_MLP=0 keeps the torch ops (A/B runs).
#include <torch/torch.h>

namespace mhla {

enum class GeluForm { exact, tanh };

// x [..., in] -> [..., out] with fc1 = (w1 [hidden, in], b1 [hidden]) and fc2 = (w2 [out, hidden],
// b2 [out]); b1 and b2 may be undefined (bias-free layers). Autocast applies as to linear layers.
torch::Tensor gelu_mlp(const torch::Tensor& x, const torch::Tensor& w1, const torch::Tensor& b1,
                       const torch::Tensor& w2, const torch::Tensor& b2, GeluForm form);

// The same from torch ops only (the fused path's reference).
torch::Tensor gelu_mlp_reference(const torch::Tensor& x, const torch::Tensor& w1,
                                 const torch::Tensor& b1, const torch::Tensor& w2,
                                 const torch::Tensor& b2, GeluForm form);

// Whether gelu_mlp takes the fused path for these arguments (CUDA, biases, sizes that are
// multiples of 8, the switch on; the exact form's fusion is its backward).
bool gelu_mlp_fuses(const torch::Tensor& x, const torch::Tensor& w1, const torch::Tensor& b1,
                    const torch::Tensor& w2, const torch::Tensor& b2, GeluForm form);

}  // namespace mhla
