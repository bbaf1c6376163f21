#include <cmath>

#include "catch_compat.h"
#include "diffusion/noise_schedule.h"
#include "diffusion/samplers.h"
#include "test_helpers.h"

using namespace mhla;

namespace {
auto f64() { return torch::TensorOptions().dtype(torch::kFloat64); }
}  // namespace

TEST_CASE("diffusion: schedules match their definitions", "[diffusion]") {
  NoiseSchedule linear("linear", 1000);
  CHECK(linear.betas()[0].item<double>() == Approx(1e-4));
  CHECK(linear.betas()[999].item<double>() == Approx(0.02));
  double product = 1.0;
  for (int64_t t = 0; t < 1000; ++t) product *= 1.0 - linear.betas()[t].item<double>();
  CHECK(linear.alpha_bars()[999].item<double>() == Approx(product).epsilon(1e-10));
  CHECK(linear.alpha_bars()[999].item<double>() < 1e-4);  // fully noised at the end
  NoiseSchedule cosine("cosine", 1000);
  auto f = [](double t) { double x = (t / 1000 + 0.008) / 1.008 * M_PI / 2; return std::cos(x) * std::cos(x); };
  CHECK(cosine.alpha_bars()[499].item<double>() == Approx(f(500) / f(0)).epsilon(1e-9));
  CHECK_THROWS(NoiseSchedule("quadratic", 10));
}

TEST_CASE("diffusion: forward noising and the x0 estimate invert each other", "[diffusion]") {
  NoiseSchedule s("linear", 1000);
  torch::manual_seed(1);
  auto x0 = torch::randn({4, 1, 8, 8}, f64()), eps = torch::randn({4, 1, 8, 8}, f64());
  auto t = torch::tensor({0, 10, 500, 999}, torch::kLong);
  auto xt = s.add_noise(x0, eps, t);
  auto ab = s.alpha_bars()[500].item<double>();
  CHECK(test::relative_error(xt[2], std::sqrt(ab) * x0[2] + std::sqrt(1 - ab) * eps[2]) < 1e-14);
  CHECK(test::relative_error(s.predict_x0(xt, eps, t), x0) < 1e-9);
  // Marginal statistics of x_t for a fixed x_0, by sampling.
  auto many = s.add_noise(torch::full({200000}, 2.0, f64()), torch::randn({200000}, f64()),
                          torch::full({200000}, 300, torch::kLong));
  const double ab300 = s.alpha_bars()[300].item<double>();
  CHECK(many.mean().item<double>() == Approx(2.0 * std::sqrt(ab300)).margin(0.01));
  CHECK(many.var().item<double>() == Approx(1 - ab300).margin(0.01));
}

TEST_CASE("diffusion: the posterior is the Gaussian conditional of the forward process", "[diffusion]") {
  // For scalars: x_{t-1} ~ N(sqrt(abar_{t-1}) x0, 1 - abar_{t-1}), x_t | x_{t-1} ~ N(sqrt(alpha_t)
  // x_{t-1}, beta_t). Conditioning the joint Gaussian gives the posterior in closed form.
  NoiseSchedule s("cosine", 200);
  for (int64_t step : {1, 50, 199}) {
    INFO("t = " << step);
    const double ab = s.alpha_bars()[step].item<double>(), ab_prev = s.alpha_bars()[step - 1].item<double>();
    const double beta = s.betas()[step].item<double>(), alpha = 1 - beta;
    const double x0 = 0.7, xt = -1.3;
    // Joint of (x_{t-1}, x_t) given x0: means m1, m2; variances v1, v2; covariance c.
    const double m1 = std::sqrt(ab_prev) * x0, v1 = 1 - ab_prev;
    const double m2 = std::sqrt(alpha) * m1, v2 = alpha * v1 + beta, c = std::sqrt(alpha) * v1;
    const double mean = m1 + c / v2 * (xt - m2), variance = v1 - c * c / v2;
    auto t = torch::full({1}, step, torch::kLong);
    auto got_mean = s.posterior_mean(torch::full({1}, x0, f64()), torch::full({1}, xt, f64()), t);
    CHECK(got_mean.item<double>() == Approx(mean).epsilon(1e-10));
    CHECK(s.posterior_variance(t).item<double>() == Approx(variance).epsilon(1e-10));
  }
  CHECK(s.posterior_variance(torch::zeros({1}, torch::kLong)).item<double>() == 0.0);
  CHECK(std::isfinite(s.posterior_log_variance_clipped(torch::zeros({1}, torch::kLong)).item<double>()));
}

namespace {

// The exact epsilon predictor when the data are N(mu, s^2): x_t ~ N(sqrt(ab) mu, ab s^2 + 1 - ab)
// and E[eps | x_t] = sqrt(1 - ab) (x_t - sqrt(ab) mu) / (ab s^2 + 1 - ab).
EpsilonFn gaussian_oracle(const NoiseSchedule& s, double mu, double sd) {
  return [&s, mu, sd](const torch::Tensor& x, const torch::Tensor& t) {
    auto ab = s.gather(s.alpha_bars(), t, x);
    return (1 - ab).sqrt() * (x - ab.sqrt() * mu) / (ab * sd * sd + 1 - ab);
  };
}

}  // namespace

TEST_CASE("diffusion: samplers with the exact predictor reproduce a Gaussian; DDIM eta=0 is deterministic", "[diffusion]") {
  NoiseSchedule s("linear", 1000);
  const double mu = 0.3, sd = 0.2;
  auto oracle = gaussian_oracle(s, mu, sd);
  torch::manual_seed(4);
  auto noise = torch::randn({20000, 1}, f64());
  SamplerOptions options;
  options.clip_x0 = false;
  auto g1 = at::detail::createCPUGenerator(1);
  auto ddpm = ddpm_sample(s, oracle, noise, options, g1);
  CHECK(ddpm.mean().item<double>() == Approx(mu).margin(0.01));
  CHECK(ddpm.std().item<double>() == Approx(sd).margin(0.01));
  options.steps = 100;
  auto g2 = at::detail::createCPUGenerator(2), g3 = at::detail::createCPUGenerator(3);
  auto ddim_a = ddim_sample(s, oracle, noise, options, g2);
  auto ddim_b = ddim_sample(s, oracle, noise, options, g3);
  CHECK(torch::equal(ddim_a, ddim_b));  // eta = 0: the generator is never used
  CHECK(ddim_a.mean().item<double>() == Approx(mu).margin(0.01));
  CHECK(ddim_a.std().item<double>() == Approx(sd).margin(0.02));
  // eta = 1 over all T steps is DDPM's ancestral sampler.
  options.eta = 1.0;
  options.steps = 1000;
  auto g4 = at::detail::createCPUGenerator(4), g5 = at::detail::createCPUGenerator(5);
  auto stochastic_a = ddim_sample(s, oracle, noise, options, g4);
  auto stochastic_b = ddim_sample(s, oracle, noise, options, g5);
  CHECK_FALSE(torch::equal(stochastic_a, stochastic_b));
  CHECK(stochastic_a.mean().item<double>() == Approx(mu).margin(0.01));
  CHECK(stochastic_a.std().item<double>() == Approx(sd).margin(0.02));
  auto times = ddim_timesteps(1000, 50);
  CHECK(times.size() == 50);
  CHECK(times.front() == 999);
  CHECK(times.back() == 0);
}
