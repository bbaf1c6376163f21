#include "train/ema.h"

#include <algorithm>

#include "core/error.h"
#include "train/checkpoint.h"

namespace mhla {

Ema::Ema(Model& model, double decay, bool warmup) : decay_(decay), warmup_(warmup) {
  torch::NoGradGuard no_grad;
  for (const auto& item : model.named_parameters()) {
    names_.push_back(item.key());
    shadow_.push_back(item.value().detach().clone());
  }
}

double Ema::decay_at(int64_t updates_done) const {
  if (!warmup_) return decay_;
  const double n = static_cast<double>(updates_done);
  return std::min(decay_, (1.0 + n) / (10.0 + n));
}

void Ema::update(Model& model, int64_t updates_done) {
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> params;
  for (const auto& item : model.named_parameters()) params.push_back(item.value());
  // ema += (1 - decay) (param - ema)
  at::_foreach_lerp_(shadow_, params, 1.0 - decay_at(updates_done));
}

TensorMap Ema::tensors() const {
  TensorMap out;
  for (size_t i = 0; i < names_.size(); ++i) out[names_[i]] = shadow_[i];
  return out;
}

void Ema::load(const TensorMap& tensors, const std::string& file) {
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < names_.size(); ++i) {
    auto it = tensors.find(names_[i]);
    if (it == tensors.end()) fail("{}: EMA tensor '{}' is missing", file, names_[i]);
    if (it->second.sizes() != shadow_[i].sizes()) fail("{}: EMA tensor '{}' has the wrong shape", file, names_[i]);
    shadow_[i].copy_(it->second);
  }
}

std::shared_ptr<Model> model_with_ema(Model& trained, const Config& config, const TensorMap& ema,
                                      const torch::Device& device) {
  auto model = model_registry().get(config.model.name).make(config);
  TensorMap weights = model_tensors(trained);
  for (const auto& [name, tensor] : ema) weights[name] = tensor;
  load_model_weights(*model, weights, "EMA weights");
  model->to(device);
  model->eval();
  return model;
}

}  // namespace mhla
