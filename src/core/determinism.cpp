#include "core/determinism.h"

#include <ATen/Context.h>

#include <atomic>

#include "core/error.h"

namespace mhla {
namespace {

std::atomic<bool> deterministic{false};
// cuDNN's settings before the switch was turned on, restored when it is turned off.
bool cudnn_deterministic_before = false, cudnn_benchmark_before = false;

}  // namespace

void set_deterministic_sums(bool on) {
  const bool was = deterministic.exchange(on);
  auto& context = at::globalContext();
  if (on && !was) {
    cudnn_deterministic_before = context.deterministicCuDNN();
    cudnn_benchmark_before = context.benchmarkCuDNN();
    context.setDeterministicCuDNN(true);
    context.setBenchmarkCuDNN(false);
  } else if (!on && was) {
    context.setDeterministicCuDNN(cudnn_deterministic_before);
    context.setBenchmarkCuDNN(cudnn_benchmark_before);
  }
}

bool deterministic_sums() {
  return deterministic.load();
}

void require_ordered_sums(const std::string& what) {
  if (!deterministic_sums()) return;
  fail(
      "train.deterministic = true: {}: sums across CTAs by floating-point atomics, whose order "
      "(and so whose last bits) changes from run to run; use attention.backend = reference for "
      "this attention type and shape, or set train.deterministic = false",
      what);
}

}  // namespace mhla
