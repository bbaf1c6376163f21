#pragma once
// The hinge between two adaLN-Zero branches of a DiT block:
//   sum    = x + gate[sample] * branch                (the residual stream; x alone without branch)
//   normed = norm(sum) * (1 + scale[sample]) + shift[sample]   (the next branch's input)
// with per-sample [B, C] gate, shift and scale from the block's modulation. On CUDA (fp32 residual
// stream, branch in the norm's output dtype, a norm without affine part, as DiT's) it is one
// kernel each way (kernels/adaln); elsewhere, or with MHLA_FUSED_ADALN=0, the torch ops of
// adaln_hinge_reference.
#include <torch/torch.h>

#include "models/layer_norm.h"

namespace mhla {

struct AdaLnHinge {
  torch::Tensor sum, normed;
};

// x [B, N, C]; branch [B, N, C] or undefined (no residual add); gate [B, C] (undefined: 1; only
// used with branch); shift and scale [B, C].
AdaLnHinge adaln_hinge(const torch::Tensor& x, const torch::Tensor& branch,
                       const torch::Tensor& gate, const torch::Tensor& shift,
                       const torch::Tensor& scale, LayerNormImpl& norm);

// The same from torch ops (the kernel's reference).
AdaLnHinge adaln_hinge_reference(const torch::Tensor& x, const torch::Tensor& branch,
                                 const torch::Tensor& gate, const torch::Tensor& shift,
                                 const torch::Tensor& scale, LayerNormImpl& norm);

// A block's modulation output [B, k * C] as the hinge takes it: fp32 where the kernel is on for its
// device (one cast for all k vectors, not one per vector), else unchanged.
torch::Tensor adaln_modulation(const torch::Tensor& modulation);

// x * (1 + scale[sample]) + shift[sample] for x [B, N, C] and [B, C] shift and scale.
torch::Tensor modulate(const torch::Tensor& x, const torch::Tensor& shift,
                       const torch::Tensor& scale);

}  // namespace mhla
