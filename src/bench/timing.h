#pragma once
// Timing shared by the bench harnesses: mean wall milliseconds per call after warm-up calls,
// with the device synchronized around the timed loop.
#include <chrono>

#include <torch/torch.h>

namespace mhla {

inline void bench_synchronize(const torch::Device& device) {
  if (device.is_cuda()) torch::cuda::synchronize(device.index());
}

template <typename F>
double mean_ms_per_call(const torch::Device& device, int warmup, int iters, F&& f) {
  for (int i = 0; i < warmup; ++i) f();
  bench_synchronize(device);
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < iters; ++i) f();
  bench_synchronize(device);
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
             .count() /
         iters;
}

}  // namespace mhla
