#pragma once
// Exponential moving average of a model's parameters (and a copy of its buffers):
// ema = decay * ema + (1 - decay) * param after every optimizer step. Saved in checkpoints as
// ema.safetensors; generators evaluate and sample with it.
#include <string>

#include <torch/torch.h>

#include "models/model.h"
#include "train/safetensors.h"

namespace mhla {

class Ema {
 public:
  Ema(Model& model, double decay);
  void update(Model& model);
  TensorMap tensors() const;  // named like the model's tensors
  void load(const TensorMap& tensors, const std::string& file);
  double decay() const { return decay_; }

 private:
  double decay_;
  std::vector<std::string> names_;
  std::vector<torch::Tensor> shadow_;
};

}  // namespace mhla
