#pragma once
// Optimizers over parameter groups, with state that round-trips through checkpoints exactly.
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "core/config.h"
#include "core/registry.h"
#include "train/safetensors.h"

namespace mhla {

struct ParamGroup {
  std::string name;  // "decay" or "no_decay"
  std::vector<std::string> names;
  std::vector<torch::Tensor> params;
  double weight_decay = 0.0;
};

// Splits a module's parameters: weight decay on matrices and kernels; none on norms, biases,
// position/token embeddings and MHLA mixing matrices.
std::vector<ParamGroup> make_param_groups(torch::nn::Module& module, double weight_decay);
bool is_weight_decayed(const std::string& name, const torch::Tensor& param);

class Optimizer {
 public:
  explicit Optimizer(std::vector<ParamGroup> groups) : groups_(std::move(groups)) {}
  virtual ~Optimizer() = default;
  virtual void step(double lr) = 0;
  // The same update with the learning rate read from a 0-dim float tensor on the parameters'
  // device at run time, so that a captured CUDA graph replays with each step's rate. Optimizers
  // without such a kernel refuse.
  virtual void step(const torch::Tensor& lr);
  virtual const char* name() const = 0;
  void zero_grad();
  // State keyed "<param name>.<slot>", for checkpoints.
  virtual TensorMap state() const = 0;
  virtual void load_state(const TensorMap& state, const std::string& file) = 0;
  const std::vector<ParamGroup>& groups() const { return groups_; }

 protected:
  std::vector<ParamGroup> groups_;
};

struct OptimizerEntry {
  std::string description;
  std::function<std::unique_ptr<Optimizer>(std::vector<ParamGroup>, const OptimConfig&)> make;
};

Registry<OptimizerEntry>& optimizer_registry();
void register_adamw(Registry<OptimizerEntry>& registry);
void register_sgd(Registry<OptimizerEntry>& registry);

// Scales gradients so their global L2 norm is at most max_norm, without a host sync; returns
// the norm before clipping (a 0-dim tensor on the parameters' device).
torch::Tensor clip_grad_norm(const std::vector<torch::Tensor>& params, double max_norm);

// Copies checkpointed optimizer state into `slot`, checking presence and shape.
void restore_slot(const TensorMap& state, const std::string& key, torch::Tensor& slot,
                  const std::string& file);

}  // namespace mhla
