#pragma once
// The base of every model in the registry.
#include <functional>
#include <memory>
#include <string>

#include <torch/torch.h>

#include "core/config.h"
#include "core/registry.h"

namespace mhla {

class Model : public torch::nn::Module {
 public:
  // images [B, C, H, W] -> logits [B, classes] (classifiers).
  virtual torch::Tensor forward(const torch::Tensor& input) = 0;
  // Classifiers: the pooled representation before the head (FID feature space).
  virtual torch::Tensor features(const torch::Tensor& input);
  // Applies every submodule's parameter projection (e.g. MHLA mixing into [0, 1]).
  void project_parameters();
  int64_t parameter_count();
};

struct ModelEntry {
  std::string description;
  std::string task;  // the task registry entry that trains it ("classification", ...)
  std::function<std::shared_ptr<Model>(const Config&)> make;
};

Registry<ModelEntry>& model_registry();

}  // namespace mhla
