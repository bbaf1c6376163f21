#pragma once
// One training step (forward, loss, backward, clipping, optimizer, projection) captured as a
// CUDA graph and replayed: the host then launches one graph per step instead of ~1,000 kernels,
// which is what bounds small batches. The first steps run eagerly on a side stream (lazy
// initialisation, cuBLAS workspaces, autograd's device threads), the next one is captured on
// that stream with the batch copied into fixed input tensors, and every later step copies its
// batch in and replays. The learning rate travels as a device tensor the optimizer reads.
#include <functional>
#include <memory>

#include <torch/torch.h>

#include "train/task.h"

namespace mhla {

class StepGraph {
 public:
  // body: one full step on `batch` at learning rate `lr` (0-dim float tensor on the device);
  // returns the loss. drop_grads: sets every gradient to undefined (between eager steps and
  // before the capture, so the captured backward allocates them in the graph's memory pool).
  using Body = std::function<torch::Tensor(const TrainBatch& batch, const torch::Tensor& lr)>;
  StepGraph(const torch::Device& device, Body body, std::function<void()> drop_grads,
            int64_t eager_steps = 3);
  ~StepGraph();
  StepGraph(const StepGraph&) = delete;
  StepGraph& operator=(const StepGraph&) = delete;

  // Runs one step on `batch` (on the device; the same shapes every call) and returns its loss,
  // a 0-dim tensor that the next call overwrites.
  torch::Tensor step(const TrainBatch& batch, double lr);
  bool captured() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace mhla
