#pragma once
// The classification / language-modelling loss: cross-entropy of logits [..., classes] against
// integer targets [...], with torch's label-smoothing convention, averaged over the rows.
//
// On CUDA (fp32/bf16/fp16 logits) it runs kernels/cross_entropy: the loss and its gradient in one
// pass each over the logits in their own dtype, where ATen casts bf16 logits to fp32 and runs
// log_softmax and its backward over the copy (a GPT step's 32,768 x 8,192 logits: ~8 GB of
// traffic). Elsewhere, and with MHLA_FUSED_CE=0, it is torch's cross_entropy on fp32 logits.
#include <torch/torch.h>

namespace mhla {

// Mean over rows of the per-row loss (fp32 scalar; fp64 for fp64 logits).
torch::Tensor mean_cross_entropy(const torch::Tensor& logits, const torch::Tensor& targets,
                                 double label_smoothing = 0.0);

// Sum over rows (evaluation: summed negative log-likelihood).
torch::Tensor summed_cross_entropy(const torch::Tensor& logits, const torch::Tensor& targets,
                                   double label_smoothing = 0.0);

// Per-row losses [rows] through the CUDA kernels (logits on CUDA in fp32/bf16/fp16), with their
// gradient; exposed for the tests that compare it with torch.
torch::Tensor cross_entropy_rows_kernel(const torch::Tensor& logits, const torch::Tensor& targets,
                                        double label_smoothing);

// Whether mean_cross_entropy takes the kernel path for these logits.
bool cross_entropy_uses_kernel(const torch::Tensor& logits);

}  // namespace mhla
