#include "diffusion/variational_bound.h"

#include <cmath>

namespace mhla {

torch::Tensor normal_kl(const torch::Tensor& mean1, const torch::Tensor& logvar1,
                        const torch::Tensor& mean2, const torch::Tensor& logvar2) {
  return 0.5 * (-1.0 + logvar2 - logvar1 + torch::exp(logvar1 - logvar2) +
                (mean1 - mean2).pow(2) * torch::exp(-logvar2));
}

torch::Tensor discretized_gaussian_log_likelihood(const torch::Tensor& x, const torch::Tensor& mean,
                                                  const torch::Tensor& log_scale) {
  const double half_bin = 1.0 / 255.0;
  auto inv_std = torch::exp(-log_scale);
  auto cdf = [](const torch::Tensor& z) { return 0.5 * (1.0 + torch::erf(z / std::sqrt(2.0))); };
  auto centered = x - mean;
  auto cdf_plus = cdf(inv_std * (centered + half_bin));
  auto cdf_min = cdf(inv_std * (centered - half_bin));
  auto log_cdf_plus = torch::log(cdf_plus.clamp_min(1e-12));
  auto log_one_minus_cdf_min = torch::log((1.0 - cdf_min).clamp_min(1e-12));
  auto log_bin = torch::log((cdf_plus - cdf_min).clamp_min(1e-12));
  return torch::where(x < -0.999, log_cdf_plus,
                      torch::where(x > 0.999, log_one_minus_cdf_min, log_bin));
}

torch::Tensor learned_log_variance(const NoiseSchedule& schedule, const torch::Tensor& v,
                                   const torch::Tensor& t) {
  auto min_log = schedule.gather(schedule.log_variance_clipped(), t, v);
  auto max_log = schedule.gather(schedule.log_betas(), t, v);
  auto fraction = (v + 1.0) * 0.5;
  return fraction * max_log + (1.0 - fraction) * min_log;
}

torch::Tensor variational_bound_term(const NoiseSchedule& schedule, const torch::Tensor& x0,
                                     const torch::Tensor& xt, const torch::Tensor& t,
                                     const torch::Tensor& eps, const torch::Tensor& v) {
  auto x0f = x0.to(torch::kFloat32), xtf = xt.to(torch::kFloat32);
  auto model_log_var = learned_log_variance(schedule, v.to(torch::kFloat32), t);
  auto model_x0 = schedule.predict_x0(xtf, eps.detach().to(torch::kFloat32), t).clamp(-1.0, 1.0);
  auto model_mean = schedule.posterior_mean(model_x0, xtf, t);
  auto true_mean = schedule.posterior_mean(x0f, xtf, t);
  auto true_log_var = schedule.gather(schedule.log_variance_clipped(), t, xtf);
  const auto per_image = [](const torch::Tensor& x) {
    return x.flatten(1).mean(1) / std::log(2.0);
  };
  auto kl = per_image(normal_kl(true_mean, true_log_var, model_mean, model_log_var));
  auto nll = per_image(-discretized_gaussian_log_likelihood(x0f, model_mean, 0.5 * model_log_var));
  return torch::where(t == 0, nll, kl);
}

}  // namespace mhla
