#include "train/step_profiler.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>

#include <torch/csrc/autograd/profiler_kineto.h>

#include "core/error.h"
#include "core/logging.h"

namespace mhla {

namespace fs = std::filesystem;
namespace kineto = torch::autograd::profiler;
using torch::profiler::impl::ActivityType;
using torch::profiler::impl::ProfilerConfig;
using torch::profiler::impl::ProfilerState;

namespace {

struct Totals {
  double ns = 0;
  int64_t count = 0;
};

// Rows sorted by total time, longest first.
std::vector<std::pair<std::string, Totals>> by_time(const std::map<std::string, Totals>& totals) {
  std::vector<std::pair<std::string, Totals>> rows(totals.begin(), totals.end());
  std::sort(rows.begin(), rows.end(),
            [](const auto& a, const auto& b) { return a.second.ns > b.second.ns; });
  return rows;
}

// Kernel names can be whole C++ template signatures; a table cell keeps the start.
std::string cell(std::string name) {
  std::replace(name.begin(), name.end(), '|', '/');
  return name.size() > 110 ? name.substr(0, 107) + "..." : name;
}

void synchronize(const torch::Device& device) {
  if (device.is_cuda()) torch::cuda::synchronize(device.index());
}

}  // namespace

StepProfiler::StepProfiler(std::string run_dir, torch::Device device, ProfileWindow window)
    : run_dir_(std::move(run_dir)), device_(device), window_(window) {
  finished_ = window_.steps <= 0;
}

StepProfiler::~StepProfiler() {
  // A run that ends inside the window (last step, signal, error) reports the steps it recorded.
  try {
    if (active_ && recorded_ > 0) {
      finish();
    } else if (active_) {
      kineto::disableProfiler();
    } else if (!finished_) {
      logger().info("profile: the run ended before step {}; nothing was recorded",
                    window_.first_step + 1);
    }
  } catch (const std::exception& e) {
    logger().info("profile: not written ({})", e.what());
  }
}

void StepProfiler::before_step(int64_t step) {
  if (finished_ || active_ || step != window_.first_step) return;
  std::set<ActivityType> activities = {ActivityType::CPU};
  if (device_.is_cuda()) activities.insert(ActivityType::CUDA);
  const ProfilerConfig config(ProfilerState::KINETO);
  synchronize(device_);  // earlier steps' kernels stay out of the window
  kineto::prepareProfiler(config, activities);
  kineto::enableProfiler(config, activities);
  active_ = true;
  start_ = std::chrono::steady_clock::now();
}

void StepProfiler::after_step(int64_t step) {
  if (!active_) return;
  ++recorded_;
  if (recorded_ >= window_.steps) finish();
}

void StepProfiler::finish() {
  synchronize(device_);
  const double wall_ns =
      std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start_).count();
  auto result = kineto::disableProfiler();
  active_ = false;
  finished_ = true;

  const fs::path dir = fs::path(run_dir_) / "profile";
  fs::create_directories(dir);
  const std::string trace = (dir / "trace.json").string();
  result->save(trace);

  std::map<std::string, Totals> gpu, cpu;
  double gpu_ns = 0;
  for (const auto& event : result->events()) {
    const double ns = static_cast<double>(event.durationNs());
    if (event.deviceType() == c10::DeviceType::CUDA) {
      auto& t = gpu[event.name()];
      t.ns += ns;
      ++t.count;
      gpu_ns += ns;
    } else {
      auto& t = cpu[event.name()];
      t.ns += ns;
      ++t.count;
    }
  }
  const double steps = static_cast<double>(recorded_);
  const std::string summary = (dir / "summary.md").string();
  std::ofstream out(summary);
  if (!out) fail("{}: cannot write", summary);
  out << fmt::format("# Profile of training steps {}..{} on {}\n\n", window_.first_step + 1,
                     window_.first_step + recorded_, device_.str());
  out << fmt::format("Wall time {:.2f} ms per step ({} steps, synchronized at both ends; an "
                     "evaluation or checkpoint inside the window counts too).\n",
                     wall_ns / steps / 1e6, recorded_);
  if (!device_.is_cuda()) out << "\n";
  if (device_.is_cuda()) {
    out << fmt::format("GPU activity (kernels, copies, sets) {:.2f} ms per step = {:.0f} % of "
                       "the wall time; the rest is the GPU waiting for the host.\n\n",
                       gpu_ns / steps / 1e6, 100.0 * gpu_ns / std::max(wall_ns, 1.0));
    out << "| GPU kernel | ms per step | % of GPU time | calls per step |\n|---|---|---|---|\n";
    int rows = 0;
    for (const auto& [name, t] : by_time(gpu)) {
      if (++rows > 40) break;
      out << fmt::format("| `{}` | {:.3f} | {:.1f} | {:.0f} |\n", cell(name), t.ns / steps / 1e6,
                         100.0 * t.ns / std::max(gpu_ns, 1.0), static_cast<double>(t.count) / steps);
    }
    out << "\n";
  }
  out << "| CPU operator (inclusive: nested operators count in their callers too) | ms per step "
         "| calls per step |\n|---|---|---|\n";
  int rows = 0;
  for (const auto& [name, t] : by_time(cpu)) {
    if (++rows > 40) break;
    out << fmt::format("| `{}` | {:.3f} | {:.0f} |\n", cell(name), t.ns / steps / 1e6,
                       static_cast<double>(t.count) / steps);
  }
  out.close();
  if (!out) fail("{}: write failed", summary);

  std::string top;
  if (device_.is_cuda()) {
    int shown = 0;
    for (const auto& [name, t] : by_time(gpu)) {
      if (++shown > 5) break;
      top += fmt::format("{}{} {:.1f} %", top.empty() ? "" : "; ", cell(name).substr(0, 60),
                         100.0 * t.ns / std::max(gpu_ns, 1.0));
    }
  }
  logger().info("profile of {} steps: {:.2f} ms per step{}; {} and {}", recorded_,
                wall_ns / steps / 1e6,
                device_.is_cuda()
                    ? fmt::format(", GPU busy {:.0f} % (top: {})", 100.0 * gpu_ns / wall_ns, top)
                    : std::string(),
                summary, trace);
}

}  // namespace mhla
