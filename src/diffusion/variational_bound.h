#pragma once
// The variational-bound term of a diffusion model that learns its variance (Nichol & Dhariwal,
// "Improved DDPM"; DiT's learn_sigma): the model outputs v next to epsilon, its log-variance is
//   log sigma^2 = f log beta_t + (1 - f) log beta~_t,  f = (v + 1) / 2,
// and the loss adds, per image in bits per dimension, KL(q(x_{t-1} | x_t, x_0) || p(x_{t-1} | x_t))
// for t > 0 and the discretized Gaussian decoder NLL of x_0 at t = 0. The mean comes from a
// detached epsilon, so this term trains only the variance (the MSE trains the mean).
#include <torch/torch.h>

#include "diffusion/noise_schedule.h"

namespace mhla {

// KL(N(mean1, exp(logvar1)) || N(mean2, exp(logvar2))), elementwise, in nats.
torch::Tensor normal_kl(const torch::Tensor& mean1, const torch::Tensor& logvar1,
                        const torch::Tensor& mean2, const torch::Tensor& logvar2);

// log P(x) for x in [-1, 1] quantized to 256 levels (bins of width 2/255, the outer bins open
// to +-infinity) under N(mean, exp(log_scale)^2), elementwise, in nats.
torch::Tensor discretized_gaussian_log_likelihood(const torch::Tensor& x, const torch::Tensor& mean,
                                                  const torch::Tensor& log_scale);

// The model's log-variance from its v output (any shape [B, ...]) at timesteps t [B].
torch::Tensor learned_log_variance(const NoiseSchedule& schedule, const torch::Tensor& v,
                                   const torch::Tensor& t);

// Per-image bound term [B] in bits per dimension (KL for t > 0, decoder NLL at t = 0).
torch::Tensor variational_bound_term(const NoiseSchedule& schedule, const torch::Tensor& x0,
                                     const torch::Tensor& xt, const torch::Tensor& t,
                                     const torch::Tensor& eps, const torch::Tensor& v);

}  // namespace mhla
