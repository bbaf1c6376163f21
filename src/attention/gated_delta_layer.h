#pragma once
// The gated DeltaNet layer (and its KDA variant), as in fla: q, k, v projections; a short causal
// depthwise conv (width 4) with SiLU; L2-normalized q and k; beta = sigmoid(W_b x); log decay
// g = -exp(A_log) * softplus(W_a x + dt_bias), one per head (gated DeltaNet) or per key dimension
// (KDA); the delta-rule op; an output RMSNorm times a swish gate; the output projection.
// Bidirectional models (DeiT, DiT) run the causal layer core forward and over the reversed
// sequence and sum the two. The directions share every weight (the conv too, run over time
// backwards for the reversed scan), so the projections are computed once.
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
  // beta = sigmoid(W_b x) and the log decay g, both fp32 [B, N, H] ([B, N, H, D] for KDA's g).
  OpArgs decay_args(const torch::Tensor& x);
  // The delta-rule op of one direction on the conv output of the joint projection (reversed:
  // read back to front), normalized and gated by out_gate; [B, N, H, D] in the input's order,
  // and that direction's v.
  std::pair<torch::Tensor, torch::Tensor> direction(const torch::Tensor& joint,
                                                    const OpArgs& args,
                                                    const torch::Tensor& out_gate, bool reversed);
  // Output RMSNorm times swish(out_gate), both [B, N, H, D] (ATen ops with the reference
  // backend, else the fused kernel where it runs).
  torch::Tensor gated_output(const torch::Tensor& out, const torch::Tensor& out_gate);

  bool per_key_gate_;
  torch::nn::Conv1d conv_{nullptr};
  Linear beta_proj_{nullptr}, decay_proj_{nullptr}, out_gate_proj_{nullptr};
  torch::Tensor a_log_, dt_bias_, out_norm_weight_;
};

}  // namespace mhla
