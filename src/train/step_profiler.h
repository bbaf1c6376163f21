#pragma once
// Where a training step's time goes: records a window of training steps with the LibTorch
// (Kineto) profiler and writes, into <run>/profile/, the Chrome trace (trace.json, for
// chrome://tracing or Perfetto) and summary.md: on CUDA the GPU kernels grouped by name with
// their share of the GPU time and of the steps' wall time, and the CPU operators (inclusive
// times). The window starts after some warm-up steps so that lazy initialization is excluded.
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include <torch/torch.h>

namespace mhla {

struct ProfileWindow {
  int64_t first_step = 0;  // the first profiled step (global step index, 0-based)
  int64_t steps = 0;       // 0: no profiling
};

class StepProfiler {
 public:
  StepProfiler(std::string run_dir, torch::Device device, ProfileWindow window);
  ~StepProfiler();
  // Around every training step; `step` is the index of the step about to run / just run.
  void before_step(int64_t step);
  void after_step(int64_t step);
  bool done() const { return finished_; }

 private:
  void finish();

  std::string run_dir_;
  torch::Device device_;
  ProfileWindow window_;
  bool active_ = false, finished_ = false;
  int64_t recorded_ = 0;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace mhla
