#pragma once
// The training step recorded once as a CUDA graph and replayed for every later batch. A small
// model's step is about a thousand kernel launches whose CPU-side cost (dispatcher, autograd,
// launch) exceeds their GPU time; a replay issues them all at once. The kernels are the eager
// step's, and the learning rate is read from a device scalar, so one recording serves the whole
// schedule. Random numbers (dropout, drop path, diffusion noise) come from the CUDA generator,
// which advances its offset at every replay.
#include <functional>
#include <memory>

#include <torch/torch.h>

#include "train/task.h"

namespace mhla {

// One step given its batch and the learning rate as a 0-dim device tensor: forward, backward,
// clipping, optimizer, projection; returns the detached loss. It must not synchronize with the
// host or copy from host memory (both are illegal while a graph records).
using TrainStepBody = std::function<torch::Tensor(const TrainBatch&, const torch::Tensor& lr)>;

class CudaGraphStep {
 public:
  // Runs `warmup_steps` eager steps before recording, so that lazy initialization (cuBLAS
  // handles, optimizer state, autograd buffers) happens outside the recording.
  CudaGraphStep(TrainStepBody body, const torch::Device& device, int64_t warmup_steps = 3);
  ~CudaGraphStep();
  CudaGraphStep(const CudaGraphStep&) = delete;
  CudaGraphStep& operator=(const CudaGraphStep&) = delete;

  // One training step on `batch`: eager while warming up and for a batch whose shapes differ from
  // the recorded one, a replay otherwise. The returned loss is overwritten by the next call.
  torch::Tensor run(const TrainBatch& batch, double lr);
  bool recorded() const;
  // False when this build has no CUDA support.
  static bool available();

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace mhla
