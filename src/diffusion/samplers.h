#pragma once
// Samplers for epsilon-prediction models: DDPM ancestral sampling over all T steps, and DDIM
// over a subsequence of S steps with stochasticity eta (eta = 0: deterministic).
#include <functional>

#include "diffusion/noise_schedule.h"

namespace mhla {

// eps_theta(x_t, t) for a batch; t [B] int64. A model that learns its variance returns 2C
// channels, epsilon then v (see variational_bound.h): DDPM samples with that variance, DDIM
// ignores it.
using EpsilonFn = std::function<torch::Tensor(const torch::Tensor& x, const torch::Tensor& t)>;

struct SamplerOptions {
  int64_t steps = 50;           // DDIM steps (DDPM always uses all of the schedule's)
  double eta = 0.0;             // DDIM stochasticity
  bool clip_x0 = true;          // clamp the x_0 estimate to [-1, 1] (images in [-1, 1])
};

torch::Tensor ddpm_sample(const NoiseSchedule& schedule, const EpsilonFn& eps,
                          const torch::Tensor& noise, const SamplerOptions& options,
                          torch::Generator& generator);
torch::Tensor ddim_sample(const NoiseSchedule& schedule, const EpsilonFn& eps,
                          const torch::Tensor& noise, const SamplerOptions& options,
                          torch::Generator& generator);

// The S timesteps DDIM visits, descending (evenly spaced over [0, T - 1], always ending at 0).
std::vector<int64_t> ddim_timesteps(int64_t schedule_steps, int64_t steps);

}  // namespace mhla
