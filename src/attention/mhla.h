#pragma once
// Multi-head linear attention with token-level heads (arXiv 2601.07832), bidirectional form.
// Tokens come in `blocks` contiguous blocks (2-D tiles of the patch grid, block-major). Each
// block j summarizes its keys and values, S_j = sum_{t in j} phi(k_t) v_t^T, z_j = sum phi(k_t);
// a query in block i reads the mixture of all summaries through one learned M x M matrix:
//   o = phi(q) sum_j m_ij S_j / (phi(q) . sum_j m_ij z_j + eps).
#include "attention/attention_layer.h"
#include "attention/attention_op.h"

namespace mhla {

torch::Tensor mhla_reference(const torch::Tensor& q, const torch::Tensor& k,
                             const torch::Tensor& v, const OpArgs& args);

// The paper's locality init on a tiles_h x tiles_w grid of blocks:
// m_ij proportional to 1 - dist(i, j) / max_k dist(i, k) (tile-centre distance), rows summing
// to one. "uniform" gives 1/M everywhere.
torch::Tensor mhla_initial_mixing(const std::string& init, int64_t tiles_h, int64_t tiles_w);

class MhlaLayerImpl : public AttentionLayerImpl {
 public:
  MhlaLayerImpl(const AttentionSpec& spec, const AttentionType& type);
  torch::Tensor forward(const torch::Tensor& x) override;
  torch::Tensor step(const torch::Tensor& x, DecodeState& state) override;
  // Keeps the mixing matrix in [0, 1] (bidirectional) or lower-triangular in [1e-5, 1]
  // (causal) after every optimizer step.
  void project_parameters() override;
  const torch::Tensor& mixing() const { return mixing_; }

 protected:
  OpArgs op_args() const override;

 private:
  torch::Tensor causal_output(const torch::Tensor& x, const torch::Tensor& out,
                              const torch::Tensor& v);

  torch::Tensor mixing_;
  torch::Tensor out_norm_weight_;               // causal only
  Linear out_gate_{nullptr};         // causal only
};

}  // namespace mhla
