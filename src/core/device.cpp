#include "core/device.h"

#include <ATen/autocast_mode.h>

#include "core/error.h"

namespace mhla {

torch::Device resolve_device(const Config& config) {
  const auto& wanted = config.train.device;
  if (wanted == "cpu") return torch::kCPU;
  if (torch::cuda::is_available()) return torch::Device(torch::kCUDA, 0);
  if (wanted == "cuda") {
    fail("{}: train.device = cuda but no CUDA device is available (this build: {})",
         config.where("train.device"),
         torch::cuda::device_count() == 0 ? "no GPU visible" : "CUDA unusable");
  }
  return torch::kCPU;
}

bool uses_bf16_autocast(const Config& config, const torch::Device& device) {
  const auto& p = config.train.precision;
  if (p == "bf16") return true;
  if (p == "fp32") return false;
  return device.is_cuda();
}

AutocastScope::AutocastScope(const torch::Device& device, bool enabled)
    : type_(device.type()), enabled_(enabled) {
  if (!enabled_) return;
  was_enabled_ = at::autocast::is_autocast_enabled(type_);
  previous_dtype_ = at::autocast::get_autocast_dtype(type_);
  at::autocast::set_autocast_dtype(type_, at::kBFloat16);
  at::autocast::set_autocast_enabled(type_, true);
  at::autocast::increment_nesting();
}

AutocastScope::~AutocastScope() {
  if (!enabled_) return;
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  at::autocast::set_autocast_enabled(type_, was_enabled_);
  at::autocast::set_autocast_dtype(type_, previous_dtype_);
}

}  // namespace mhla
