#pragma once
// Softmax attention whose backward is the same bits on every run (train.deterministic,
// core/determinism.h). PyTorch's SDPA picks cuDNN's or FlashAttention's kernel on the GPU, and
// both add the query gradient across CTAs in arrival order, so two DiT runs at 1,024 tokens with
// the switch still ended with different weights (session 33). FlashAttention has an ordered
// backward, which ATen takes only while its deterministic-algorithms flag is set without
// warn-only; setting that flag for the whole run would make every op without a deterministic
// form throw (and cuBLAS demand CUBLAS_WORKSPACE_CONFIG), so it is set around this backward only.
#include <torch/torch.h>

namespace mhla {

// Whether the ordered flash path takes these [B, H, N, D] inputs: CUDA, 16-bit, D a multiple
// of 8 up to 256, and deterministic sums on.
bool deterministic_flash_takes(const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v);

// softmax(q k^T / sqrt(D)) v on [B, H, N, D] inputs (the SDPA layout), causal or not, through
// FlashAttention with the ordered backward.
torch::Tensor deterministic_flash_attention(const torch::Tensor& q, const torch::Tensor& k,
                                            const torch::Tensor& v, bool causal);

}  // namespace mhla
