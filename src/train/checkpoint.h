#pragma once
// A checkpoint is a folder: model.safetensors (weights and buffers, fp32), optimizer.safetensors
// (optimizer slots), trainer.json (step, data position, RNG states, best accuracy, times) and
// config.yaml (the resolved config, so eval and resume need nothing else). It is written into a
// staging folder, every file fsynced, then swapped into place atomically.
#include <string>

#include "core/config.h"
#include "models/model.h"
#include "train/optimizer.h"
#include "train/safetensors.h"

namespace mhla {

struct TrainerState {
  int64_t step = 0;             // optimizer steps done
  int64_t epoch = 0;            // epoch in progress
  int64_t batch_in_epoch = 0;   // batches of that epoch done
  double best_score = 0.0;      // best evaluation score so far (valid once best_step >= 0)
  int64_t best_step = -1;
  double train_seconds = 0.0;   // training time so far, evaluation excluded
  std::string cpu_rng;          // hex of the CPU generator state
  std::string cuda_rng;         // hex of the CUDA generator state ("" if none)
};

struct Checkpoint {
  std::string dir;
  Config config;
  TensorMap weights;
  TensorMap optimizer;
  TensorMap ema;  // empty when the run keeps no EMA
  TrainerState state;
};

void save_checkpoint(const std::string& dir, const Config& config, Model& model,
                     const Optimizer* optimizer, const TrainerState& state,
                     const TensorMap& ema = {});
// `path` is a checkpoint folder or a run folder (then checkpoints/best, else checkpoints/last).
std::string resolve_checkpoint_dir(const std::string& path);
Checkpoint read_checkpoint(const std::string& path, const std::vector<std::string>& overrides = {});
// Copies weights into the model; names and shapes must match exactly.
void load_model_weights(Model& model, const TensorMap& weights, const std::string& file);
TensorMap model_tensors(Model& model);

std::string capture_rng_state(bool cuda);
void restore_rng_state(const std::string& hex, bool cuda, const std::string& file);

}  // namespace mhla
