#include "models/transformer_block.h"

namespace mhla {

torch::Tensor drop_path(const torch::Tensor& branch, double rate, bool training) {
  if (!training || rate <= 0.0) return branch;
  const double keep = 1.0 - rate;
  std::vector<int64_t> shape(branch.dim(), 1);
  shape[0] = branch.size(0);
  auto mask = torch::rand(shape, branch.options().dtype(torch::kFloat32)).lt(keep);
  return branch * (mask.to(branch.scalar_type()) / keep);
}

MlpImpl::MlpImpl(int64_t dim, int64_t hidden) {
  fc1_ = register_module("fc1", torch::nn::Linear(dim, hidden));
  fc2_ = register_module("fc2", torch::nn::Linear(hidden, dim));
}

torch::Tensor MlpImpl::forward(const torch::Tensor& x) {
  return fc2_->forward(torch::gelu(fc1_->forward(x)));
}

TransformerBlockImpl::TransformerBlockImpl(std::shared_ptr<AttentionLayerImpl> attention,
                                           int64_t dim, int64_t mlp_hidden, double drop_path_rate)
    : drop_path_rate_(drop_path_rate) {
  norm1_ = register_module("norm1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim})));
  attention_ = register_module("attn", std::move(attention));
  norm2_ = register_module("norm2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim})));
  mlp_ = register_module("mlp", Mlp(dim, mlp_hidden));
}

torch::Tensor TransformerBlockImpl::forward(const torch::Tensor& x) {
  auto y = x + drop_path(attention_->forward(norm1_->forward(x)), drop_path_rate_, is_training());
  return y + drop_path(mlp_->forward(norm2_->forward(y)), drop_path_rate_, is_training());
}

}  // namespace mhla
