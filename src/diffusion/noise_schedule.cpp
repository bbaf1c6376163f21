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
}

torch::Tensor NoiseSchedule::gather(const torch::Tensor& c, const torch::Tensor& t,
                                    const torch::Tensor& like) const {
  auto values = c.to(like.device()).index_select(0, t.to(like.device()).to(torch::kLong))
                    .to(like.scalar_type());
  std::vector<int64_t> shape(like.dim(), 1);
  shape[0] = like.size(0);
  return values.view(shape);
}

torch::Tensor NoiseSchedule::add_noise(const torch::Tensor& x0, const torch::Tensor& noise,
                                       const torch::Tensor& t) const {
  return gather(alpha_bars_.sqrt(), t, x0) * x0 + gather((1.0 - alpha_bars_).sqrt(), t, x0) * noise;
}

torch::Tensor NoiseSchedule::predict_x0(const torch::Tensor& xt, const torch::Tensor& eps,
                                        const torch::Tensor& t) const {
  return (xt - gather((1.0 - alpha_bars_).sqrt(), t, xt) * eps) / gather(alpha_bars_.sqrt(), t, xt);
}

torch::Tensor NoiseSchedule::posterior_mean(const torch::Tensor& x0, const torch::Tensor& xt,
                                            const torch::Tensor& t) const {
  auto c0 = alpha_bars_prev_.sqrt() * betas_ / (1.0 - alpha_bars_);
  auto ct = (1.0 - betas_).sqrt() * (1.0 - alpha_bars_prev_) / (1.0 - alpha_bars_);
  return gather(c0, t, x0) * x0 + gather(ct, t, xt) * xt;
}

torch::Tensor NoiseSchedule::posterior_variance(const torch::Tensor& t) const {
  auto variance = betas_ * (1.0 - alpha_bars_prev_) / (1.0 - alpha_bars_);
  return variance.index_select(0, t.cpu().to(torch::kLong));
}

torch::Tensor NoiseSchedule::posterior_log_variance_clipped(const torch::Tensor& t) const {
  auto variance = betas_ * (1.0 - alpha_bars_prev_) / (1.0 - alpha_bars_);
  auto clipped = torch::cat({variance.narrow(0, 1, 1), variance.narrow(0, 1, steps_ - 1)});
  return clipped.log().index_select(0, t.cpu().to(torch::kLong));
}

}  // namespace mhla
