// AdamW through ATen's fused multi-tensor kernel (one launch per group on CUDA; CPU supported
// too), with state slots exp_avg, exp_avg_sq and step per parameter.
#include "core/error.h"
#include "train/optimizer.h"

namespace mhla {
namespace {

class AdamW : public Optimizer {
 public:
  AdamW(std::vector<ParamGroup> groups, const OptimConfig& config)
      : Optimizer(std::move(groups)), config_(config) {
    for (auto& group : groups_) {
      for (auto& p : group.params) {
        exp_avg_.push_back(torch::zeros_like(p, torch::MemoryFormat::Preserve));
        exp_avg_sq_.push_back(torch::zeros_like(p, torch::MemoryFormat::Preserve));
        steps_.push_back(torch::zeros({}, p.options().dtype(torch::kFloat32)));
      }
    }
  }

  void step(double lr) override { update(lr); }
  void step(const torch::Tensor& lr) override { update(lr); }
  const char* name() const override { return "adamw"; }

  TensorMap state() const override {
    TensorMap out;
    size_t index = 0;
    for (const auto& group : groups_) {
      for (const auto& name : group.names) {
        out[name + ".exp_avg"] = exp_avg_[index];
        out[name + ".exp_avg_sq"] = exp_avg_sq_[index];
        out[name + ".step"] = steps_[index];
        ++index;
      }
    }
    return out;
  }

  void load_state(const TensorMap& state, const std::string& file) override {
    size_t index = 0;
    for (const auto& group : groups_) {
      for (const auto& name : group.names) {
        restore_slot(state, name + ".exp_avg", exp_avg_[index], file);
        restore_slot(state, name + ".exp_avg_sq", exp_avg_sq_[index], file);
        restore_slot(state, name + ".step", steps_[index], file);
        ++index;
      }
    }
  }

 private:
  // Rate: a double, or a 0-dim float tensor on the parameters' device read by the kernel.
  template <typename Rate>
  void update(const Rate& lr) {
    torch::NoGradGuard no_grad;
    size_t index = 0;
    for (auto& group : groups_) {
      std::vector<torch::Tensor> params, grads, m, v, steps;
      for (auto& p : group.params) {
        if (p.grad().defined()) {
          params.push_back(p);
          grads.push_back(p.grad());
          m.push_back(exp_avg_[index]);
          v.push_back(exp_avg_sq_[index]);
          steps.push_back(steps_[index]);
        }
        ++index;
      }
      if (params.empty()) continue;
      at::_foreach_add_(steps, 1.0);  // the fused kernel expects the step already counted
      at::_fused_adamw_(params, grads, m, v, /*max_exp_avg_sqs=*/{}, steps, lr, config_.beta1,
                        config_.beta2, group.weight_decay, config_.eps, /*amsgrad=*/false,
                        /*maximize=*/false);
    }
  }

  OptimConfig config_;
  std::vector<torch::Tensor> exp_avg_, exp_avg_sq_, steps_;
};

}  // namespace

void register_adamw(Registry<OptimizerEntry>& registry) {
  registry.add("adamw", {"AdamW (decoupled weight decay), ATen fused kernel",
                         [](std::vector<ParamGroup> groups, const OptimConfig& config) {
                           return std::make_unique<AdamW>(std::move(groups), config);
                         }});
}

}  // namespace mhla
