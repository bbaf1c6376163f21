#pragma once
// The part of a LayerNorm backward launch that the LayerNorm and the residual add + norm bindings
// share (CUDA builds only): the kernel arguments for one call and the fp32 weight/bias gradient
// buffers they point into.
#ifdef MHLA_WITH_CUDA_KERNELS
#include <torch/torch.h>

#include "layer_norm/layer_norm.h"

namespace mhla {

// The dtype the norm kernels write: under autocast the autocast dtype (what the next matmul would
// cast to; torch's layer_norm would write fp32), else x's.
torch::ScalarType layer_norm_output_type(const torch::Tensor& x);

struct LayerNormParamGrads {
  torch::Tensor dweight, dbias, workspace;  // undefined without a weight
};

// x: the forward's (contiguous) input, dy: the output gradient (contiguous), stats: the forward's
// [2, rows] mean and rstd, weight: 0 elements when the norm has no affine part, dx: allocated by
// the caller like x. Allocates `grads` when there is a weight.
mhla_kernels::LayerNormBackwardArgs layer_norm_backward_args(
    const torch::Tensor& x, const torch::Tensor& dy, const torch::Tensor& stats,
    const torch::Tensor& weight, torch::Tensor& dx, LayerNormParamGrads& grads);

}  // namespace mhla
#endif
