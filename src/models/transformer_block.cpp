#include "models/transformer_block.h"

#include <tuple>

#include "core/error.h"
#include "models/residual_add.h"
#include "models/residual_norm.h"

namespace mhla {

MlpKind mlp_kind(const std::string& name) {
  if (name == "gelu") return MlpKind::gelu;
  if (name == "gelu_tanh") return MlpKind::gelu_tanh;
  if (name == "swiglu") return MlpKind::swiglu;
  fail("model.mlp: unknown MLP kind '{}' (gelu, gelu_tanh, swiglu)", name);
}

MlpImpl::MlpImpl(int64_t dim, int64_t hidden, bool bias, GeluForm form) : form_(form) {
  fc1_ = register_module("fc1", Linear(torch::nn::LinearOptions(dim, hidden).bias(bias)));
  fc2_ = register_module("fc2", Linear(torch::nn::LinearOptions(hidden, dim).bias(bias)));
}

torch::Tensor MlpImpl::forward(const torch::Tensor& x) {
  return gelu_mlp(x, fc1_->weight, fc1_->bias, fc2_->weight, fc2_->bias, form_);
}

SwiGluMlpImpl::SwiGluMlpImpl(int64_t dim, int64_t hidden) {
  w1_ = register_module("w1", Linear(torch::nn::LinearOptions(dim, hidden).bias(false)));
  w2_ = register_module("w2", Linear(torch::nn::LinearOptions(hidden, dim).bias(false)));
  w3_ = register_module("w3", Linear(torch::nn::LinearOptions(dim, hidden).bias(false)));
}

torch::Tensor SwiGluMlpImpl::forward(const torch::Tensor& x) {
  return w2_->forward(torch::silu(w1_->forward(x)) * w3_->forward(x));
}

TransformerBlockImpl::TransformerBlockImpl(std::shared_ptr<AttentionLayerImpl> attention,
                                           int64_t dim, int64_t mlp_hidden, double drop_path_rate,
                                           MlpKind mlp_kind, bool bias)
    : drop_path_rate_(drop_path_rate) {
  norm1_ = register_module("norm1", LayerNorm(dim));
  attention_ = register_module("attn", std::move(attention));
  norm2_ = register_module("norm2", LayerNorm(dim));
  if (mlp_kind == MlpKind::swiglu) {
    SwiGluMlp mlp(dim, mlp_hidden);
    register_module("mlp", mlp.ptr());
    mlp_ = torch::nn::AnyModule(mlp);
  } else {
    Mlp mlp(dim, mlp_hidden, bias,
            mlp_kind == MlpKind::gelu_tanh ? GeluForm::tanh : GeluForm::exact);
    register_module("mlp", mlp.ptr());
    mlp_ = torch::nn::AnyModule(mlp);
  }
}

torch::Tensor TransformerBlockImpl::forward(const torch::Tensor& x) {
  auto y = residual_add(x, attention_->forward(norm1_->forward(x)), drop_path_rate_, is_training());
  return residual_add(y, mlp_.forward<torch::Tensor>(norm2_->forward(y)), drop_path_rate_,
                      is_training());
}

std::pair<torch::Tensor, torch::Tensor> TransformerBlockImpl::forward_normed(
    const torch::Tensor& x, const torch::Tensor& normed, LayerNormImpl& next_norm) {
  auto middle =
      residual_add_norm(x, attention_->forward(normed), drop_path_rate_, is_training(), *norm2_);
  auto out = residual_add_norm(middle.sum, mlp_.forward<torch::Tensor>(middle.normed),
                               drop_path_rate_, is_training(), next_norm);
  return {out.sum, out.normed};
}

torch::Tensor forward_blocks(std::vector<TransformerBlock>& blocks, torch::Tensor x,
                             LayerNormImpl& final_norm) {
  auto normed = blocks.front()->norm1().forward(x);
  for (size_t i = 0; i < blocks.size(); ++i) {
    auto& next_norm = i + 1 < blocks.size() ? blocks[i + 1]->norm1() : final_norm;
    std::tie(x, normed) = blocks[i]->forward_normed(x, normed, next_norm);
  }
  return normed;
}

torch::Tensor TransformerBlockImpl::step(const torch::Tensor& x, DecodeState& state) {
  auto y = x + attention_->step(norm1_->forward(x), state);
  return y + mlp_.forward<torch::Tensor>(norm2_->forward(y));
}

}  // namespace mhla
