#include "train/optimizer.h"

#include "core/error.h"

namespace mhla {

bool is_weight_decayed(const std::string& name, const torch::Tensor& param) {
  if (param.dim() < 2) return false;  // norms, biases, scalars
  const auto leaf = name.substr(name.rfind('.') + 1);
  return !(leaf == "pos_embed" || leaf == "mixing" || name.find("embedding") != std::string::npos);
}

std::vector<ParamGroup> make_param_groups(torch::nn::Module& module, double weight_decay) {
  ParamGroup decay{"decay", {}, {}, weight_decay};
  ParamGroup no_decay{"no_decay", {}, {}, 0.0};
  for (const auto& item : module.named_parameters()) {
    if (!item.value().requires_grad()) continue;
    ParamGroup& group = is_weight_decayed(item.key(), item.value()) ? decay : no_decay;
    group.names.push_back(item.key());
    group.params.push_back(item.value());
  }
  return {decay, no_decay};
}

void Optimizer::zero_grad() {
  for (auto& group : groups_)
    for (auto& p : group.params) p.mutable_grad() = torch::Tensor();
}

void Optimizer::step(const torch::Tensor&) {
  fail("optimizer '{}' cannot take its learning rate from a device tensor, so it cannot run "
       "inside a CUDA graph (train.cuda_graph); use optim.name = adamw or train.cuda_graph = false",
       name());
}

torch::Tensor clip_grad_norm(const std::vector<torch::Tensor>& params, double max_norm) {
  std::vector<torch::Tensor> grads;
  for (const auto& p : params)
    if (p.grad().defined()) grads.push_back(p.grad());
  if (grads.empty()) return torch::zeros({});
  auto norms = at::_foreach_norm(grads, 2);
  auto total = torch::stack(norms).to(torch::kFloat32).norm();
  if (max_norm > 0) {
    auto coef = (max_norm / (total + 1e-6)).clamp_max(1.0);
    at::_foreach_mul_(grads, coef);
  }
  return total;
}

void restore_slot(const TensorMap& state, const std::string& key, torch::Tensor& slot,
                  const std::string& file) {
  auto it = state.find(key);
  if (it == state.end()) fail("{}: optimizer state '{}' is missing", file, key);
  if (it->second.sizes() != slot.sizes()) {
    fail("{}: optimizer state '{}' has shape {}, the model needs {}", file, key,
         c10::str(it->second.sizes()), c10::str(slot.sizes()));
  }
  torch::NoGradGuard no_grad;
  slot.copy_(it->second);
}

Registry<OptimizerEntry>& optimizer_registry() {
  static Registry<OptimizerEntry> registry("optimizer");
  return registry;
}

}  // namespace mhla
