#pragma once
// Class-conditional image generation from a DiT: DDIM (steps, eta) or DDPM ancestral sampling,
// with classifier-free guidance, in batches, from one noise seed. Used by `mhla sample`,
// `mhla eval --fid` and the training-time FID / sample-grid hooks.
#include <cstdint>
#include <string>

#include <torch/torch.h>

#include "core/config.h"
#include "models/model.h"

namespace mhla {

class Dit;

struct GenerateOptions {
  int64_t count = 16;
  int64_t label = -1;  // -1: labels cycle 0, 1, ..., classes-1
  int64_t steps = 50;  // DDIM steps (DDPM uses all diffusion steps)
  double cfg = 1.0;    // guidance scale (1 = none)
  double eta = 0.0;
  std::string sampler = "ddim";
  uint64_t seed = 0;
  int64_t batch = 256;
  bool log_progress = false;
};

struct Generated {
  torch::Tensor images;  // float32 [count, C, S, S] on the CPU, in [-1, 1]
  torch::Tensor labels;  // int64 [count]
};

// A DiT from a checkpoint, ready to sample on `device` (eval mode): the EMA weights when the
// run kept them (fixed buffers as trained) unless raw_weights. Fails, naming the checkpoint,
// when it is not a dit. `what` names the command for that message.
struct SamplingModel {
  std::shared_ptr<Model> model;
  Dit* dit = nullptr;
  bool ema = false;
};
struct Checkpoint;
SamplingModel load_sampling_model(const Checkpoint& checkpoint, const torch::Device& device,
                                  bool raw_weights, const std::string& what);

// The model must be in eval mode with the weights to sample from (the EMA, usually).
Generated generate_images(Dit& dit, const Config& config, const torch::Device& device,
                          const GenerateOptions& options);

}  // namespace mhla
