#include "diffusion/noise_schedule.h"

#include <cmath>

#include "core/error.h"

namespace mhla {

NoiseSchedule::NoiseSchedule(const std::string& kind, int64_t steps) : steps_(steps) {
  if (steps < 2) fail("noise schedule: {} steps; need at least 2", steps);
  auto f64 = torch::TensorOptions().dtype(torch::kFloat64);
  if (kind == "linear") {
    // DDPM's range for 1000 steps, rescaled so other step counts keep the same total noise.
    const double scale = 1000.0 / static_cast<double>(steps);
    betas_ = torch::linspace(scale * 1e-4, scale * 0.02, steps, f64);
  } else if (kind == "cosine") {
    auto f = [&](double t) {
      const double x = (t / static_cast<double>(steps) + 0.008) / 1.008 * M_PI / 2;
      return std::cos(x) * std::cos(x);
    };
    std::vector<double> betas(steps);
    for (int64_t i = 0; i < steps; ++i) betas[i] = std::min(1.0 - f(i + 1) / f(i), 0.999);
    betas_ = torch::tensor(betas, f64);
  } else {
    fail("noise schedule: unknown kind '{}' (linear, cosine)", kind);
  }
  alpha_bars_ = torch::cumprod(1.0 - betas_, 0);
  alpha_bars_prev_ = torch::cat({torch::ones({1}, f64), alpha_bars_.narrow(0, 0, steps - 1)});
  derive_tables();
}

void NoiseSchedule::derive_tables() {
  sqrt_alpha_bars_ = alpha_bars_.sqrt();
  sqrt_one_minus_alpha_bars_ = (1.0 - alpha_bars_).sqrt();
  posterior_x0_coef_ = alpha_bars_prev_.sqrt() * betas_ / (1.0 - alpha_bars_);
  posterior_xt_coef_ = (1.0 - betas_).sqrt() * (1.0 - alpha_bars_prev_) / (1.0 - alpha_bars_);
  posterior_variance_ = betas_ * (1.0 - alpha_bars_prev_) / (1.0 - alpha_bars_);
  log_variance_clipped_ = torch::cat({posterior_variance_.narrow(0, 1, 1),
                                      posterior_variance_.narrow(0, 1, steps_ - 1)})
                              .log();
  log_betas_ = betas_.log();
}

NoiseSchedule NoiseSchedule::to(const torch::Device& device) const {
  NoiseSchedule moved = *this;
  for (auto* table : {&moved.betas_, &moved.alpha_bars_, &moved.alpha_bars_prev_,
                      &moved.sqrt_alpha_bars_, &moved.sqrt_one_minus_alpha_bars_,
                      &moved.posterior_x0_coef_, &moved.posterior_xt_coef_,
                      &moved.posterior_variance_, &moved.log_variance_clipped_, &moved.log_betas_}) {
    *table = table->to(device);
  }
  return moved;
}

torch::Tensor NoiseSchedule::gather(const torch::Tensor& c, const torch::Tensor& t,
                                    const torch::Tensor& like) const {
  // With the tables on like's device (to()), this is one index_select: no copy of the table and
  // no host round trip (a synchronization) in every training step.
  auto values = c.index_select(0, t.to(c.device()).to(torch::kLong))
                    .to(like.device())
                    .to(like.scalar_type());
  std::vector<int64_t> shape(like.dim(), 1);
  shape[0] = like.size(0);
  return values.view(shape);
}

torch::Tensor NoiseSchedule::add_noise(const torch::Tensor& x0, const torch::Tensor& noise,
                                       const torch::Tensor& t) const {
  return gather(sqrt_alpha_bars_, t, x0) * x0 + gather(sqrt_one_minus_alpha_bars_, t, x0) * noise;
}

torch::Tensor NoiseSchedule::predict_x0(const torch::Tensor& xt, const torch::Tensor& eps,
                                        const torch::Tensor& t) const {
  return (xt - gather(sqrt_one_minus_alpha_bars_, t, xt) * eps) / gather(sqrt_alpha_bars_, t, xt);
}

torch::Tensor NoiseSchedule::posterior_mean(const torch::Tensor& x0, const torch::Tensor& xt,
                                            const torch::Tensor& t) const {
  return gather(posterior_x0_coef_, t, x0) * x0 + gather(posterior_xt_coef_, t, xt) * xt;
}

torch::Tensor NoiseSchedule::posterior_variance(const torch::Tensor& t) const {
  return posterior_variance_.index_select(0, t.to(posterior_variance_.device()).to(torch::kLong));
}

torch::Tensor NoiseSchedule::posterior_log_variance_clipped(const torch::Tensor& t) const {
  return log_variance_clipped_.index_select(
      0, t.to(log_variance_clipped_.device()).to(torch::kLong));
}

}  // namespace mhla
