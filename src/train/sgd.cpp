// SGD with Nesterov momentum and decoupled-free (L2) weight decay, as torch.optim.SGD.
#include "train/optimizer.h"

namespace mhla {
namespace {

class Sgd : public Optimizer {
 public:
  Sgd(std::vector<ParamGroup> groups, const OptimConfig& config)
      : Optimizer(std::move(groups)), config_(config) {
    for (auto& group : groups_)
      for (auto& p : group.params) momentum_.push_back(torch::zeros_like(p));
  }

  using Optimizer::step;
  const char* name() const override { return "sgd"; }
  void step(double lr) override {
    torch::NoGradGuard no_grad;
    size_t index = 0;
    for (auto& group : groups_) {
      for (auto& p : group.params) {
        auto& buf = momentum_[index++];
        if (!p.grad().defined()) continue;
        auto grad = p.grad();
        if (group.weight_decay > 0) grad = grad.add(p, group.weight_decay);
        buf.mul_(config_.momentum).add_(grad);
        p.add_(grad.add(buf, config_.momentum), -lr);  // Nesterov
      }
    }
  }

  TensorMap state() const override {
    TensorMap out;
    size_t index = 0;
    for (const auto& group : groups_)
      for (const auto& name : group.names) out[name + ".momentum"] = momentum_[index++];
    return out;
  }

  void load_state(const TensorMap& state, const std::string& file) override {
    size_t index = 0;
    for (const auto& group : groups_)
      for (const auto& name : group.names)
        restore_slot(state, name + ".momentum", momentum_[index++], file);
  }

 private:
  OptimConfig config_;
  std::vector<torch::Tensor> momentum_;
};

}  // namespace

void register_sgd(Registry<OptimizerEntry>& registry) {
  registry.add("sgd", {"SGD with Nesterov momentum (optim.momentum) and L2 weight decay",
                       [](std::vector<ParamGroup> groups, const OptimConfig& config) {
                         return std::make_unique<Sgd>(std::move(groups), config);
                       }});
}

}  // namespace mhla
