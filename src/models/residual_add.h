#pragma once
// The residual update of a pre-norm block with stochastic depth:
//   x + drop_path(branch) = x + branch * keep_mask[sample] / (1 - rate)
// (the mask is drawn per sample when training with rate > 0). On CUDA, for an fp32 residual
// stream and a bf16/fp16/fp32 branch (autocast), one fused kernel pass (kernels/residual_add)
// instead of ATen's mixed-dtype add plus the mask multiply; elsewhere the same formula in torch
// ops. MHLA_FUSED_NORM=0 turns the kernel off together with the norm kernels.
#include <torch/torch.h>

namespace mhla {

torch::Tensor residual_add(const torch::Tensor& x, const torch::Tensor& branch, double drop_rate,
                           bool training);

// The per-sample scale residual_add draws (undefined when nothing is dropped): exposed so tests
// can rebuild the result from torch ops with the same random draw.
torch::Tensor drop_path_scale(int64_t batch, double drop_rate, bool training,
                              const torch::Device& device);

// x + branch * scale[sample] from torch ops (the reference of the kernel path).
torch::Tensor residual_add_reference(const torch::Tensor& x, const torch::Tensor& branch,
                                     const torch::Tensor& scale);

}  // namespace mhla
