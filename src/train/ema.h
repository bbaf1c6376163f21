#pragma once
// Exponential moving average of a model's parameters (and a copy of its buffers):
// ema = decay * ema + (1 - decay) * param after every optimizer step. Saved in checkpoints as
// ema.safetensors; generators sample with it and classifiers are evaluated with it (the trained
// weights' accuracy reported beside).
#include <string>

#include <torch/torch.h>

#include "core/config.h"
#include "models/model.h"
#include "train/safetensors.h"

namespace mhla {

class Ema {
 public:
  // warmup: the decay ramps as min(decay, (1 + n) / (10 + n)) over the first updates (n = updates
  // before this one), so a short run averages trained weights rather than the initialization.
  Ema(Model& model, double decay, bool warmup = false);
  // `updates_done` is the number of earlier updates (the trainer's step count, so resumes agree).
  void update(Model& model, int64_t updates_done = 0);
  double decay_at(int64_t updates_done) const;
  TensorMap tensors() const;  // named like the model's tensors
  void load(const TensorMap& tensors, const std::string& file);
  double decay() const { return decay_; }

 private:
  double decay_;
  bool warmup_;
  std::vector<std::string> names_;
  std::vector<torch::Tensor> shadow_;
};

// A fresh model of config.model.name holding `trained`'s tensors with the EMA's in place of those
// it tracks (the rest, fixed buffers, as trained), on `device`, in eval mode.
std::shared_ptr<Model> model_with_ema(Model& trained, const Config& config, const TensorMap& ema,
                                      const torch::Device& device);

}  // namespace mhla
