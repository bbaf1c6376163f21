#include "models/deit.h"

#include <cmath>

#include "attention/attention_type.h"
#include "attention/owned_parameters.h"
#include "core/error.h"

namespace mhla {
namespace {

void truncated_normal_(torch::Tensor t, double std) {
  torch::NoGradGuard no_grad;
  t.normal_(0.0, std).clamp_(-2.0 * std, 2.0 * std);
}

void init_weights(torch::nn::Module& module) {
  for (auto& item : module.named_parameters()) {
    const std::string& name = item.key();
    torch::Tensor& p = item.value();
    const auto leaf = name.substr(name.rfind('.') + 1);
    if (attention_owns_init(name)) continue;
    torch::NoGradGuard no_grad;
    if (leaf == "bias") {
      p.zero_();
    } else if (p.dim() >= 2) {
      truncated_normal_(p, 0.02);
    } else if (name.find("norm") != std::string::npos) {
      p.fill_(1.0);
    }
  }
}

}  // namespace

TokenLayout image_token_layout(const Config& config) {
  const auto& type = attention_registry().get(config.attention.type);
  const int64_t side = type.uses_blocks
                           ? static_cast<int64_t>(std::llround(std::sqrt(config.attention.blocks)))
                           : 1;
  const int64_t raw_grid = (config.model.image_size + config.model.patch_size - 1) /
                           config.model.patch_size;
  const int64_t grid = (raw_grid + side - 1) / side * side;
  TokenLayout layout;
  layout.grid_h = layout.grid_w = grid;
  layout.tiles_h = layout.tiles_w = side;
  return layout;
}

Deit::Deit(const Config& config) : config_(config), layout_(image_token_layout(config)) {
  const auto& m = config.model;
  const int64_t padded = layout_.grid_h * m.patch_size;
  pad_before_ = (padded - m.image_size) / 2;
  pad_after_ = padded - m.image_size - pad_before_;
  patch_embed_ = register_module(
      "patch_embed", torch::nn::Conv2d(torch::nn::Conv2dOptions(m.in_channels, m.width,
                                                                m.patch_size)
                                           .stride(m.patch_size)));
  pos_embed_ = register_parameter("pos_embed", torch::zeros({1, layout_.tokens(), m.width}));

  const auto& type = attention_registry().get(config.attention.type);
  AttentionSpec spec;
  spec.dim = m.width;
  spec.heads = m.heads;
  spec.layout = layout_;
  spec.causal = false;
  spec.bias = m.bias;
  spec.config = config.attention;
  spec.where = config.where("attention.backend");
  const int64_t hidden = static_cast<int64_t>(std::llround(m.width * m.mlp_ratio));
  auto block_list = register_module("blocks", torch::nn::ModuleList());
  for (int64_t i = 0; i < m.depth; ++i) {
    const double rate = m.depth > 1 ? m.drop_path * static_cast<double>(i) / (m.depth - 1) : 0.0;
    blocks_.push_back(TransformerBlock(type.make_layer(spec, type), m.width, hidden, rate,
                                       mlp_kind(m.mlp), m.bias));
    block_list->push_back(blocks_.back());
  }
  norm_ = register_module("norm", LayerNorm(m.width));
  head_ = register_module("head", Linear(m.width, m.num_classes));
  init_weights(*this);
}

torch::Tensor Deit::forward(const torch::Tensor& images) {
  const auto& m = config_.model;
  TORCH_CHECK(images.dim() == 4 && images.size(1) == m.in_channels &&
                  images.size(2) == m.image_size && images.size(3) == m.image_size,
              "deit: expected images [B, ", m.in_channels, ", ", m.image_size, ", ",
              m.image_size, "], got ", images.sizes());
  auto x = images;
  if (pad_before_ + pad_after_ > 0) {
    x = torch::constant_pad_nd(x, {pad_before_, pad_after_, pad_before_, pad_after_}, 0.0);
  }
  x = layout_.to_tokens(patch_embed_->forward(x)) + pos_embed_;
  x = forward_blocks(blocks_, x, *norm_).mean(1);
  return head_->forward(x);
}

void register_deit(Registry<ModelEntry>& registry) {
  registry.add("deit", {"DeiT-style ViT classifier (patch embedding, pre-norm blocks, mean pool)",
                        "classification",
                        [](const Config& c) { return std::make_shared<Deit>(c); }});
}

}  // namespace mhla
