#pragma once
// Gated DeltaNet (one decay per head and token) and KDA (one per key dimension) through the fused
// chunked CUDA kernels of kernels/gated_delta/chunk_fused.h, as an autograd function: gradients
// for q, k, v, beta, g and the initial state. Same conventions as delta_rule_chunked
// (attention/gated_delta.h): q, k [B, T, H, D], v [B, T, H, D], beta [B, T, H], g [B, T, H]
// (gated DeltaNet) or [B, T, H, D] (KDA), initial state [B, H, D, D] fp32 or undefined; returns
// o in v's dtype and the fp32 final state.
#include <torch/torch.h>

#include "attention/gated_delta.h"

namespace mhla {

// Whether the fused kernels take these inputs: a CUDA build, CUDA tensors, v in bf16 or fp16,
// a gate per head or per key dimension, and Dk == Dv in {64, 128}. Others go through
// delta_rule_chunked.
bool gated_delta_fused_takes(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                             const torch::Tensor& g);

DeltaRuleOutput gated_delta_fused(const torch::Tensor& q, const torch::Tensor& k,
                                  const torch::Tensor& v, const torch::Tensor& beta,
                                  const torch::Tensor& g, const torch::Tensor& initial_state,
                                  double scale);

}  // namespace mhla
