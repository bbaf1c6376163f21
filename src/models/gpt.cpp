#include "models/gpt.h"

#include <cmath>
#include <sstream>

#include "attention/attention_type.h"
#include "attention/owned_parameters.h"
#include "core/error.h"

namespace mhla {

std::vector<std::string> layer_attention_types(const Config& config) {
  std::vector<std::string> pattern;
  if (config.attention.pattern.empty()) {
    pattern.push_back(config.attention.type);
  } else {
    std::stringstream list(config.attention.pattern);
    std::string item;
    while (std::getline(list, item, ',')) pattern.push_back(item);
  }
  std::vector<std::string> types;
  for (int64_t i = 0; i < config.model.depth; ++i) types.push_back(pattern[i % pattern.size()]);
  return types;
}

Gpt::Gpt(const Config& config) : config_(config) {
  const auto& m = config.model;
  token_embedding_ = register_module("token_embedding", torch::nn::Embedding(m.vocab_size, m.width));
  if (m.positions == "learned") {
    position_embedding_ =
        register_module("position_embedding", torch::nn::Embedding(m.context, m.width));
  }
  auto block_list = register_module("blocks", torch::nn::ModuleList());
  const MlpKind mlp = mlp_kind(m.mlp);
  const bool swiglu = mlp == MlpKind::swiglu;
  // SwiGLU's three matrices at 2/3 of the hidden width keep the parameter count of GELU's two.
  int64_t hidden = static_cast<int64_t>(std::llround(m.width * m.mlp_ratio));
  if (swiglu) hidden = (hidden * 2 / 3 + 63) / 64 * 64;
  const auto types = layer_attention_types(config);
  for (int64_t i = 0; i < m.depth; ++i) {
    const auto& type = attention_registry().get(types[i]);
    if (std::find(type.causal_modes.begin(), type.causal_modes.end(), true) == type.causal_modes.end()) {
      fail("{}: attention type '{}' has no causal form", config.where("attention.type"), types[i]);
    }
    AttentionSpec spec;
    spec.dim = m.width;
    spec.heads = m.heads;
    spec.layout = TokenLayout{1, m.context, 1, 1};
    spec.causal = true;
    spec.rotary = m.positions == "rope";
    spec.bias = m.bias;
    spec.config = config.attention;
    spec.config.type = types[i];
    spec.where = config.where("attention.backend");
    const double rate = m.depth > 1 ? m.drop_path * static_cast<double>(i) / (m.depth - 1) : 0.0;
    blocks_.push_back(
        TransformerBlock(type.make_layer(spec, type), m.width, hidden, rate, mlp, m.bias));
    block_list->push_back(blocks_.back());
  }
  norm_ = register_module("norm", LayerNorm(m.width));
  // GPT-2 style init: N(0, 0.02) for matrices and embeddings, zero biases; output projections
  // of each residual branch scaled by 1/sqrt(2 * depth).
  torch::NoGradGuard no_grad;
  for (auto& item : named_parameters()) {
    const std::string& name = item.key();
    auto& p = item.value();
    const auto leaf = name.substr(name.rfind('.') + 1);
    if (attention_owns_init(name) || name.find("norm") != std::string::npos) continue;
    if (leaf == "bias") {
      p.zero_();
    } else if (p.dim() >= 2 && name.find("conv") == std::string::npos) {
      const bool residual_out = name.find("attn.proj.weight") != std::string::npos ||
                                name.find("mlp.fc2.weight") != std::string::npos ||
                                name.find("mlp.w2.weight") != std::string::npos;
      p.normal_(0.0, residual_out ? 0.02 / std::sqrt(2.0 * m.depth) : 0.02);
    }
  }
}

torch::Tensor Gpt::forward(const torch::Tensor& tokens) {
  TORCH_CHECK(tokens.dim() == 2, "gpt: expected tokens [B, T]");
  const auto t = tokens.size(1);
  TORCH_CHECK(position_embedding_.is_empty() || t <= config_.model.context,
              "gpt: ", t, " tokens exceed the learned positions (model.context = ",
              config_.model.context, ")");
  auto x = token_embedding_->forward(tokens);
  if (!position_embedding_.is_empty()) {
    x = x + position_embedding_->forward(torch::arange(t, tokens.options()));
  }
  return torch::matmul(forward_blocks(blocks_, x, *norm_), token_embedding_->weight.t());  // tied head
}

std::vector<DecodeState> Gpt::new_decode_states() const {
  return std::vector<DecodeState>(blocks_.size());
}

torch::Tensor Gpt::step(const torch::Tensor& token, std::vector<DecodeState>& states) {
  TORCH_CHECK(token.dim() == 2 && token.size(1) == 1, "gpt: step takes tokens [B, 1]");
  TORCH_CHECK(states.size() == blocks_.size(), "gpt: one decode state per layer");
  const int64_t position = states.front().position;
  auto x = token_embedding_->forward(token);
  if (!position_embedding_.is_empty()) {
    TORCH_CHECK(position < config_.model.context, "gpt: position ", position,
                " is beyond the learned positions (model.context = ", config_.model.context, ")");
    x = x + position_embedding_->forward(torch::full({1}, position, token.options()));
  }
  for (size_t i = 0; i < blocks_.size(); ++i) x = blocks_[i]->step(x, states[i]);
  return torch::matmul(norm_->forward(x), token_embedding_->weight.t());
}

void register_gpt(Registry<ModelEntry>& registry) {
  registry.add("gpt", {"GPT-style causal language model (tied embeddings, RoPE or learned positions)",
                       "language_model", [](const Config& c) { return std::make_shared<Gpt>(c); }});
}

}  // namespace mhla
