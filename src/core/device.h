#pragma once
// Device and numeric precision of a run: train.device / train.precision resolved against the
// machine, and a scope that turns on autocast for the forward pass.
#include <string>

#include <torch/torch.h>

#include "core/config.h"

namespace mhla {

torch::Device resolve_device(const Config& config);
// bf16 autocast on CUDA unless train.precision says fp32; fp32 on CPU unless it says bf16.
bool uses_bf16_autocast(const Config& config, const torch::Device& device);

class AutocastScope {
 public:
  AutocastScope(const torch::Device& device, bool enabled);
  ~AutocastScope();
  AutocastScope(const AutocastScope&) = delete;
  AutocastScope& operator=(const AutocastScope&) = delete;

 private:
  at::DeviceType type_;
  bool enabled_, was_enabled_ = false;
  at::ScalarType previous_dtype_ = at::kFloat;
};

}  // namespace mhla
