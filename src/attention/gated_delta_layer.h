#pragma once
// The gated DeltaNet layer (and its KDA variant), as in fla: q, k, v projections; a short causal
// depthwise conv (width 4) with SiLU; L2-normalized q and k; beta = sigmoid(W_b x); log decay
// g = -exp(A_log) * softplus(W_a x + dt_bias), one per head (gated DeltaNet) or per key dimension
// (KDA); the delta-rule op; an output RMSNorm times a swish gate; the output projection.
// Bidirectional models (DeiT, DiT) run the causal layer core forward and over the reversed
// sequence and sum the two (each direction keeps its own causal conv).
#include "attention/attention_layer.h"

namespace mhla {

class GatedDeltaLayerImpl : public AttentionLayerImpl {
 public:
  static constexpr int64_t kConvWidth = 4;

  GatedDeltaLayerImpl(const AttentionSpec& spec, const AttentionType& type, bool per_key_gate);
  torch::Tensor forward(const torch::Tensor& x) override;
  // Decoding keeps the last kConvWidth - 1 projected rows (the conv window) and the fp32 state.
  torch::Tensor step(const torch::Tensor& x, DecodeState& state) override;

 private:
  // One causal pass: x [B, N, dim] -> (gated, normalized attention output [B, N, dim], v).
  std::pair<torch::Tensor, torch::Tensor> causal_core(const torch::Tensor& x);
  // From the conv output [B, N, 3 dim]: q, k (L2-normalized), v as [B, N, H, D], and the op args.
  std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, OpArgs> prepare(
      const torch::Tensor& x, const torch::Tensor& conv_out);
  // Output RMSNorm x swish gate: [B, N, H, D] -> [B, N, dim].
  torch::Tensor gated_output(const torch::Tensor& x, const torch::Tensor& out);

  bool per_key_gate_;
  torch::nn::Conv1d conv_{nullptr};
  Linear beta_proj_{nullptr}, decay_proj_{nullptr}, out_gate_proj_{nullptr};
  torch::Tensor a_log_, dt_bias_, out_norm_weight_;
};

}  // namespace mhla
