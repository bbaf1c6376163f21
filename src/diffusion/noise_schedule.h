#pragma once
// DDPM noise schedule (Ho et al. 2020) and its closed forms, in float64:
//   q(x_t | x_0) = N(sqrt(abar_t) x_0, (1 - abar_t) I),  abar_t = prod_{s<=t} (1 - beta_s)
//   q(x_{t-1} | x_t, x_0) = N(c0_t x_0 + ct_t x_t, beta~_t I) with
//     c0_t = sqrt(abar_{t-1}) beta_t / (1 - abar_t), ct_t = sqrt(alpha_t) (1 - abar_{t-1}) / (1 - abar_t),
//     beta~_t = beta_t (1 - abar_{t-1}) / (1 - abar_t)   (abar_{-1} = 1).
// Timesteps are 0-based: t = 0 is the least noisy of the T steps.
#include <string>

#include <torch/torch.h>

namespace mhla {

class NoiseSchedule {
 public:
  // kind: "linear" (beta from 1e-4 to 0.02, the DDPM/DiT setting) or "cosine" (Nichol & Dhariwal).
  NoiseSchedule(const std::string& kind, int64_t steps);
  // The same schedule with its tables on `device` (training keeps them beside the data).
  NoiseSchedule to(const torch::Device& device) const;

  int64_t steps() const { return steps_; }
  const torch::Tensor& betas() const { return betas_; }            // [T] float64
  const torch::Tensor& alpha_bars() const { return alpha_bars_; }  // [T] float64
  const torch::Tensor& log_betas() const { return log_betas_; }    // [T] float64
  // log beta~_t per t, t = 0 clipped to t = 1 (the table behind posterior_log_variance_clipped).
  const torch::Tensor& log_variance_clipped() const { return log_variance_clipped_; }

  // x_t from x_0 and noise; t [B] int64 (any device; coefficients follow x0's dtype and device).
  torch::Tensor add_noise(const torch::Tensor& x0, const torch::Tensor& noise,
                          const torch::Tensor& t) const;
  // The model's x_0 estimate from an epsilon prediction.
  torch::Tensor predict_x0(const torch::Tensor& xt, const torch::Tensor& eps,
                           const torch::Tensor& t) const;
  // Posterior q(x_{t-1} | x_t, x_0): mean and variance (variance per sample, [B]).
  torch::Tensor posterior_mean(const torch::Tensor& x0, const torch::Tensor& xt,
                               const torch::Tensor& t) const;
  torch::Tensor posterior_variance(const torch::Tensor& t) const;
  // log beta~_t, with t = 0 clipped to t = 1 as in DDPM's implementation (beta~_0 = 0).
  torch::Tensor posterior_log_variance_clipped(const torch::Tensor& t) const;

  // Per-sample coefficient c[t] ([T] table) broadcast to like's shape, dtype and device.
  torch::Tensor gather(const torch::Tensor& c, const torch::Tensor& t, const torch::Tensor& like) const;

 private:
  void derive_tables();

  int64_t steps_;
  torch::Tensor betas_, alpha_bars_, alpha_bars_prev_;
  // Derived once: the coefficients every call gathers by timestep.
  torch::Tensor sqrt_alpha_bars_, sqrt_one_minus_alpha_bars_, posterior_x0_coef_,
      posterior_xt_coef_, posterior_variance_, log_variance_clipped_, log_betas_;
};

}  // namespace mhla
