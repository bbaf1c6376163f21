#pragma once
// What the trainer trains on: a task supplies the batches of each epoch, the loss of a model
// output and the evaluation. Classification (images -> labels) and language modelling (tokens ->
// next tokens) share the same trainer, checkpoints, schedule and logs.
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "core/config.h"
#include "core/registry.h"
#include "models/model.h"
#include "train/safetensors.h"

namespace mhla {

struct TrainBatch {
  torch::Tensor input, target;  // on the training device
  int64_t index = 0;            // batch index in the epoch
};

class BatchStream {
 public:
  virtual ~BatchStream() = default;
  virtual std::optional<TrainBatch> next() = 0;
};

struct EvalReport {
  nlohmann::json metrics;  // written under "eval" in metrics.jsonl
  double score = 0.0;      // higher is better: picks checkpoints/best
  std::string summary;     // for the log line
};

class Task {
 public:
  virtual ~Task() = default;
  virtual std::string describe() const = 0;  // data sizes, for the first log line
  virtual const char* unit() const = 0;      // what the rate counts: "img", "tok"
  virtual int64_t samples_per_step() const = 0;
  virtual int64_t steps_per_epoch() const = 0;
  virtual std::unique_ptr<BatchStream> epoch(int64_t epoch, int64_t start_batch) = 0;
  // The loss of one batch (the trainer runs it under autocast). Default: the loss of
  // model.forward(input) against target; tasks that drive the model differently override it.
  virtual torch::Tensor training_loss(Model& model, const TrainBatch& batch);
  virtual torch::Tensor loss(const torch::Tensor& output, const torch::Tensor& target) const = 0;
  virtual EvalReport evaluate(Model& model) = 0;
  // The run folder and, when the run keeps an EMA, its weights (generators sample with them);
  // called once by the trainer before training.
  virtual void attach_run(const std::string& run_dir, std::function<TensorMap()> sampling_weights) {}
};

struct TaskEntry {
  std::string description;
  std::function<std::unique_ptr<Task>(const Config&, const torch::Device&)> make;
};

Registry<TaskEntry>& task_registry();
void register_classification_task(Registry<TaskEntry>& registry);
void register_language_model_task(Registry<TaskEntry>& registry);
void register_diffusion_task(Registry<TaskEntry>& registry);

}  // namespace mhla
