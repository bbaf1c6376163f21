#pragma once
// The hinge between two pre-norm branches: sum = x + drop_path(branch), normed = LayerNorm(sum).
// On CUDA (fp32 residual stream, branch in the norm's output dtype) it is one kernel each way
// (kernels/layer_norm with its residual option): the forward adds, writes the fp32 sum and the
// normalized row in one pass; the backward adds the residual stream's gradient to the norm's
// input gradient and writes the branch gradient (scaled, in its dtype) in the same pass. The
// separate ops cost an extra read of the sum, an autograd add of the two gradients of `sum` and a
// cast of the branch gradient. Elsewhere (and with MHLA_FUSED_NORM=0 or
// MHLA_FUSED_RESIDUAL_NORM=0): residual_add, then the norm — the same random draw for stochastic
// depth either way.
#include <utility>

#include <torch/torch.h>

#include "models/layer_norm.h"

namespace mhla {

struct ResidualNorm {
  torch::Tensor sum, normed;
};

ResidualNorm residual_add_norm(const torch::Tensor& x, const torch::Tensor& branch,
                               double drop_rate, bool training, LayerNormImpl& norm);

// The same with a given per-sample scale (undefined: none); the separate form here is the torch
// formula (the tests' reference).
ResidualNorm residual_add_norm_with_scale(const torch::Tensor& x, const torch::Tensor& branch,
                                          const torch::Tensor& scale, LayerNormImpl& norm);

}  // namespace mhla
