#include "models/dit.h"

#include <cmath>

#include "attention/attention_type.h"
#include "attention/owned_parameters.h"
#include "core/error.h"
#include "models/deit.h"

namespace mhla {
namespace {

constexpr int64_t kFrequencyDim = 256;

LayerNorm plain_norm(int64_t dim) {
  return LayerNorm(dim, /*affine=*/false, /*eps=*/1e-6);
}

}  // namespace

torch::Tensor timestep_embedding(const torch::Tensor& t, int64_t dim) {
  const int64_t half = dim / 2;
  auto f32 = torch::TensorOptions().dtype(torch::kFloat32).device(t.device());
  auto frequencies = torch::exp(-std::log(10000.0) * torch::arange(half, f32) / static_cast<double>(half));
  auto args = t.to(torch::kFloat32).unsqueeze(1) * frequencies.unsqueeze(0);
  return torch::cat({torch::cos(args), torch::sin(args)}, 1);
}

torch::Tensor sincos_position_embedding(int64_t grid_h, int64_t grid_w, int64_t dim) {
  // Half the channels encode the row, half the column; each half is [sin, cos] of pos * omega.
  auto one_axis = [](const torch::Tensor& positions, int64_t d) {
    auto omega = 1.0 / torch::pow(10000.0, torch::arange(d / 2, torch::kFloat64) / (d / 2.0));
    auto out = positions.to(torch::kFloat64).unsqueeze(1) * omega.unsqueeze(0);
    return torch::cat({torch::sin(out), torch::cos(out)}, 1);
  };
  auto rows = torch::arange(grid_h, torch::kLong).repeat_interleave(grid_w);
  auto cols = torch::arange(grid_w, torch::kLong).repeat({grid_h});
  return torch::cat({one_axis(rows, dim / 2), one_axis(cols, dim / 2)}, 1).to(torch::kFloat32);
}

DitBlockImpl::DitBlockImpl(std::shared_ptr<AttentionLayerImpl> attention, int64_t dim,
                           int64_t mlp_hidden, bool bias, GeluForm gelu) {
  norm1_ = register_module("norm1", plain_norm(dim));
  attention_ = register_module("attn", std::move(attention));
  norm2_ = register_module("norm2", plain_norm(dim));
  mlp_ = register_module("mlp", Mlp(dim, mlp_hidden, bias, gelu));
  modulation_ = register_module("modulation", Linear(dim, 6 * dim));
}

std::vector<torch::Tensor> DitBlockImpl::modulation(const torch::Tensor& silu_condition) {
  return adaln_modulation(modulation_->forward(silu_condition)).chunk(6, 1);
}

AdaLnHinge DitBlockImpl::forward(const torch::Tensor& x, const torch::Tensor& normed,
                                 const std::vector<torch::Tensor>& m,
                                 const torch::Tensor& next_shift, const torch::Tensor& next_scale,
                                 LayerNormImpl& next_norm) {
  // y = x + gate1 * attn(...); the MLP input is norm2(y) modulated by shift2 and scale2.
  auto middle = adaln_hinge(x, attention_->forward(normed), m[2], m[3], m[4], *norm2_);
  return adaln_hinge(middle.sum, mlp_->forward(middle.normed), m[5], next_shift, next_scale,
                     next_norm);
}

Dit::Dit(const Config& config) : config_(config), layout_(image_token_layout(config)) {
  const auto& m = config.model;
  const int64_t padded = layout_.grid_h * m.patch_size;
  pad_before_ = (padded - m.image_size) / 2;
  pad_after_ = padded - m.image_size - pad_before_;
  patch_embed_ = register_module(
      "patch_embed",
      torch::nn::Conv2d(torch::nn::Conv2dOptions(m.in_channels, m.width, m.patch_size).stride(m.patch_size)));
  // Fixed (not learned) position embedding, laid out block-major like the tokens.
  auto raster = sincos_position_embedding(layout_.grid_h, layout_.grid_w, m.width);
  auto grid = raster.t().reshape({1, m.width, layout_.grid_h, layout_.grid_w});
  pos_embed_ = register_buffer("pos_embed", layout_.to_tokens(grid));
  time_fc1_ = register_module("time_fc1", Linear(kFrequencyDim, m.width));
  time_fc2_ = register_module("time_fc2", Linear(m.width, m.width));
  class_embedding_ = register_module("class_embedding", torch::nn::Embedding(m.num_classes + 1, m.width));

  const auto& type = attention_registry().get(config.attention.type);
  AttentionSpec spec;
  spec.dim = m.width;
  spec.heads = m.heads;
  spec.layout = layout_;
  spec.config = config.attention;
  spec.where = config.where("attention.backend");
  spec.bias = m.bias;
  const int64_t hidden = static_cast<int64_t>(std::llround(m.width * m.mlp_ratio));
  auto block_list = register_module("blocks", torch::nn::ModuleList());
  for (int64_t i = 0; i < m.depth; ++i) {
    blocks_.push_back(DitBlock(type.make_layer(spec, type), m.width, hidden, m.bias,
                               mlp_kind(m.mlp) == MlpKind::gelu_tanh ? GeluForm::tanh
                                                                     : GeluForm::exact));
    block_list->push_back(blocks_.back());
  }
  final_norm_ = register_module("final_norm", plain_norm(m.width));
  final_modulation_ = register_module("final_modulation", Linear(m.width, 2 * m.width));
  final_linear_ = register_module(
      "final_linear", Linear(m.width, m.patch_size * m.patch_size * output_channels()));

  // DiT's init: Xavier-uniform linears, N(0, 0.02) class and time MLP weights, patch embedding
  // like a linear; adaLN modulations and the final layer zero (each block starts as identity).
  torch::NoGradGuard no_grad;
  for (auto& item : named_parameters()) {
    const std::string& name = item.key();
    auto& p = item.value();
    const auto leaf = name.substr(name.rfind('.') + 1);
    if (attention_owns_init(name) || name.find("norm") != std::string::npos) continue;
    if (leaf == "bias") {
      p.zero_();
    } else if (name.rfind("class_embedding", 0) == 0 || name.rfind("time_fc", 0) == 0) {
      p.normal_(0.0, 0.02);
    } else if (p.dim() >= 2 && name.find("conv") == std::string::npos && name.find("cpe") == std::string::npos) {
      auto flat = p.view({p.size(0), -1});
      torch::nn::init::xavier_uniform_(flat);
    }
  }
  for (auto& block : blocks_) {
    for (auto& item : block->named_parameters()) {
      if (item.key().rfind("modulation", 0) == 0) item.value().zero_();
    }
  }
  final_modulation_->weight.zero_();
  final_modulation_->bias.zero_();
  final_linear_->weight.zero_();
  final_linear_->bias.zero_();
}

torch::Tensor Dit::forward(const torch::Tensor&) {
  fail("dit: a diffusion model is called through denoise(x_t, t, y)");
}

torch::Tensor Dit::denoise(const torch::Tensor& x, const torch::Tensor& t, const torch::Tensor& y) {
  const auto& m = config_.model;
  TORCH_CHECK(x.dim() == 4 && x.size(1) == m.in_channels && x.size(2) == m.image_size &&
                  x.size(3) == m.image_size,
              "dit: expected images [B, ", m.in_channels, ", ", m.image_size, ", ", m.image_size, "]");
  auto input = x;
  if (pad_before_ + pad_after_ > 0) {
    input = torch::constant_pad_nd(input, {pad_before_, pad_after_, pad_before_, pad_after_}, 0.0);
  }
  auto tokens = layout_.to_tokens(patch_embed_->forward(input)) + pos_embed_;
  auto time = time_fc2_->forward(torch::silu(time_fc1_->forward(timestep_embedding(t, kFrequencyDim))));
  auto condition = torch::silu(time + class_embedding_->forward(y));
  // Every modulation depends on the condition alone, so all are computed first: each hinge
  // between two branches then needs the next block's shift and scale.
  std::vector<std::vector<torch::Tensor>> modulations;
  for (auto& block : blocks_) modulations.push_back(block->modulation(condition));
  auto fm = adaln_modulation(final_modulation_->forward(condition)).chunk(2, 1);
  auto stream =
      adaln_hinge(tokens, {}, {}, modulations[0][0], modulations[0][1], blocks_[0]->norm1());
  for (size_t i = 0; i < blocks_.size(); ++i) {
    const bool last = i + 1 == blocks_.size();
    stream = blocks_[i]->forward(stream.sum, stream.normed, modulations[i],
                                 last ? fm[0] : modulations[i + 1][0],
                                 last ? fm[1] : modulations[i + 1][1],
                                 last ? *final_norm_ : blocks_[i + 1]->norm1());
  }
  auto out = final_linear_->forward(stream.normed);
  // Unpatchify: [B, N, p*p*C] (block-major) -> [B, C, S', S'], then drop the padding.
  const int64_t p = m.patch_size, c = output_channels(), b = x.size(0);
  auto grid = layout_.to_grid(out);  // [B, p*p*C, gh, gw]
  auto image = grid.view({b, p, p, c, layout_.grid_h, layout_.grid_w})
                   .permute({0, 3, 4, 1, 5, 2})
                   .reshape({b, c, layout_.grid_h * p, layout_.grid_w * p});
  return image.narrow(2, pad_before_, m.image_size).narrow(3, pad_before_, m.image_size);
}

void register_dit(Registry<ModelEntry>& registry) {
  registry.add("dit", {"DiT class-conditional diffusion transformer (adaLN-Zero, patchify 2)",
                       "diffusion", [](const Config& c) { return std::make_shared<Dit>(c); }});
}

}  // namespace mhla
