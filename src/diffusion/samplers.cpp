#include "diffusion/samplers.h"

#include <cmath>

#include "core/error.h"
#include "diffusion/variational_bound.h"

namespace mhla {

std::vector<int64_t> ddim_timesteps(int64_t schedule_steps, int64_t steps) {
  if (steps < 1 || steps > schedule_steps) {
    fail("sampler: {} steps; need 1..{}", steps, schedule_steps);
  }
  std::vector<int64_t> out;
  for (int64_t i = steps - 1; i >= 0; --i) {
    out.push_back(steps == 1 ? schedule_steps - 1
                             : static_cast<int64_t>(std::llround(static_cast<double>(i) *
                                                                 (schedule_steps - 1) / (steps - 1))));
  }
  return out;
}

torch::Tensor ddpm_sample(const NoiseSchedule& schedule, const EpsilonFn& eps,
                          const torch::Tensor& noise, const SamplerOptions& options,
                          torch::Generator& generator) {
  auto x = noise;
  const auto b = x.size(0);
  for (int64_t step = schedule.steps() - 1; step >= 0; --step) {
    auto t = torch::full({b}, step, torch::TensorOptions().dtype(torch::kLong).device(x.device()));
    auto out = eps(x, t);
    const int64_t channels = x.size(1);
    auto x0 = schedule.predict_x0(x, out.narrow(1, 0, channels), t);
    if (options.clip_x0) x0 = x0.clamp(-1.0, 1.0);
    auto mean = schedule.posterior_mean(x0, x, t);
    if (step == 0) {
      x = mean;
    } else {
      auto z = at::normal(0.0, 1.0, x.sizes(), generator, x.options().device(torch::kCPU)).to(x.device());
      if (out.size(1) == 2 * channels) {  // learned variance
        x = mean + torch::exp(0.5 * learned_log_variance(schedule, out.narrow(1, channels, channels), t)) * z;
      } else {
        const double sd = std::sqrt(schedule.posterior_variance(t.narrow(0, 0, 1)).item<double>());
        x = mean + sd * z;
      }
    }
  }
  return x;
}

torch::Tensor ddim_sample(const NoiseSchedule& schedule, const EpsilonFn& eps,
                          const torch::Tensor& noise, const SamplerOptions& options,
                          torch::Generator& generator) {
  auto x = noise;
  const auto b = x.size(0);
  const auto times = ddim_timesteps(schedule.steps(), options.steps);
  for (size_t i = 0; i < times.size(); ++i) {
    const int64_t step = times[i];
    const double ab = schedule.alpha_bars()[step].item<double>();
    const double ab_prev = i + 1 < times.size() ? schedule.alpha_bars()[times[i + 1]].item<double>() : 1.0;
    auto t = torch::full({b}, step, torch::TensorOptions().dtype(torch::kLong).device(x.device()));
    auto e = eps(x, t).narrow(1, 0, x.size(1));  // epsilon (a learned variance is unused)
    auto x0 = (x - std::sqrt(1 - ab) * e) / std::sqrt(ab);
    if (options.clip_x0) {
      x0 = x0.clamp(-1.0, 1.0);
      e = (x - std::sqrt(ab) * x0) / std::sqrt(1 - ab);  // the noise consistent with the clipped x_0
    }
    const double sigma = options.eta * std::sqrt((1 - ab_prev) / (1 - ab)) * std::sqrt(1 - ab / ab_prev);
    x = std::sqrt(ab_prev) * x0 + std::sqrt(std::max(0.0, 1 - ab_prev - sigma * sigma)) * e;
    if (sigma > 0) {
      x = x + sigma * at::normal(0.0, 1.0, x.sizes(), generator, x.options().device(torch::kCPU)).to(x.device());
    }
  }
  return x;
}

}  // namespace mhla
