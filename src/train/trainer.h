#pragma once
// The training loop: config -> model, task (data, loss, evaluation), optimizer, schedule; one
// step is next batch -> forward (bf16 autocast on CUDA) -> task loss -> backward -> clip ->
// optimizer -> projection of constrained parameters (with train.cuda_graph: captured once as a
// CUDA graph and replayed, train/step_graph.h). Evaluates, logs and checkpoints into the run
// folder.
#include <memory>
#include <string>

#include "core/config.h"
#include "core/determinism.h"
#include "models/model.h"
#include "train/checkpoint.h"
#include "train/ema.h"
#include "train/optimizer.h"
#include "train/run_folder.h"
#include "train/step_graph.h"
#include "train/step_profiler.h"
#include "train/task.h"

namespace mhla {

struct TrainOutcome {
  bool interrupted = false;
  int signal = 0;  // the signal that stopped it (0 if stop_after_step did)
  int64_t steps = 0;
  nlohmann::json final_eval;  // the last full evaluation's metrics (null if none)
  double final_score = -1.0;  // its score (classification: accuracy)
  double train_seconds = 0.0;
  std::string run_dir;
};

class Trainer {
 public:
  // A new run (create_run_folder first) or, with resume, the run's checkpoints/last.
  Trainer(const Config& config, const std::string& run_dir, bool resume);
  TrainOutcome run();
  // Stop as if interrupted once this many steps are done (tests; 0 = never).
  void stop_after_step(int64_t step) { stop_after_ = step; }
  // Profile `steps` training steps after `warmup` steps of this invocation (<run>/profile/).
  void profile_steps(int64_t steps, int64_t warmup) { profile_ = {warmup, steps}; }
  Model& model() { return *model_; }
  // Whether train.cuda_graph captured the step (tests).
  bool step_graph_captured() const { return step_graph_ && step_graph_->captured(); }
  // Optimizer steps done so far (resumed runs count from their checkpoint).
  int64_t steps_done() const { return state_.step; }

 private:
  void save(const std::string& name);
  void evaluate_and_record(int64_t epoch);
  // Forward under autocast, loss, backward and gradient clipping; returns the detached loss.
  torch::Tensor forward_backward(const TrainBatch& batch);
  // One eager step: forward_backward, optimizer, projection, gradients dropped.
  torch::Tensor eager_step(const TrainBatch& batch, double lr);

  Config config_;
  // train.deterministic for this trainer's lifetime (set before anything runs on the GPU).
  DeterministicSumsScope deterministic_sums_;
  std::string run_dir_;
  torch::Device device_;
  bool bf16_;
  std::shared_ptr<Model> model_;
  std::unique_ptr<Optimizer> optimizer_;
  std::unique_ptr<Ema> ema_;
  std::vector<torch::Tensor> params_;
  std::unique_ptr<Task> task_;
  std::unique_ptr<StepGraph> step_graph_;  // train.cuda_graph: the captured step
  TrainerState state_;
  MetricsLog metrics_;
  int64_t steps_per_epoch_ = 0, total_steps_ = 0;
  int64_t stop_after_ = 0;
  ProfileWindow profile_;  // first_step relative to this invocation's first step
  EvalReport last_eval_;
  bool evaluated_ = false;
};

}  // namespace mhla
