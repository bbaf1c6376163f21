#include <cmath>

#include "catch_compat.h"
#include "eval/frechet.h"
#include "test_helpers.h"

using namespace mhla;

namespace {

auto f64() { return torch::TensorOptions().dtype(torch::kFloat64); }

GaussianFit exact(const torch::Tensor& mean, const torch::Tensor& covariance) {
  return {mean, covariance, 1000};
}

// Tr((A B)^1/2) through a Denman-Beavers iteration on the (non-symmetric) product: independent of
// the eigen-decomposition route the library takes.
double trace_sqrt_product(const torch::Tensor& a, const torch::Tensor& b) {
  auto y = a.matmul(b), z = torch::eye(a.size(0), f64());
  for (int i = 0; i < 100; ++i) {
    auto y_next = 0.5 * (y + torch::inverse(z));
    auto z_next = 0.5 * (z + torch::inverse(y));
    y = y_next;
    z = z_next;
  }
  return y.trace().item<double>();
}

torch::Tensor random_spd(int64_t d, double scale) {
  auto m = torch::randn({d, d}, f64());
  return scale * (m.matmul(m.t()) / static_cast<double>(d) + 0.1 * torch::eye(d, f64()));
}

}  // namespace

TEST_CASE("fid: closed forms", "[eval]") {
  // Diagonal covariances: FID = |m1 - m2|^2 + sum (s1 - s2)^2.
  auto m1 = torch::tensor({0.0, 1.0, 2.0}, f64()), m2 = torch::tensor({1.0, 1.0, 0.0}, f64());
  auto s1 = torch::tensor({1.0, 4.0, 9.0}, f64()), s2 = torch::tensor({4.0, 4.0, 1.0}, f64());
  const double expected = 1 + 0 + 4 + (1 - 2) * (1 - 2) + 0 + (3 - 1) * (3 - 1);
  CHECK(frechet_distance(exact(m1, torch::diag(s1)), exact(m2, torch::diag(s2))) == Approx(expected).epsilon(1e-12));
  // Proportional covariances S2 = c S1: Tr term = (1 + c - 2 sqrt(c)) Tr(S1).
  torch::manual_seed(1);
  auto s = random_spd(6, 1.0);
  const double c = 2.5;
  CHECK(frechet_distance(exact(torch::zeros({6}, f64()), s), exact(torch::zeros({6}, f64()), c * s)) ==
        Approx((1 + c - 2 * std::sqrt(c)) * s.trace().item<double>()).epsilon(1e-10));
  // A set against itself.
  auto fit = exact(m1, torch::diag(s1));
  CHECK(std::abs(frechet_distance(fit, fit)) < 1e-10);
}

TEST_CASE("fid: non-commuting covariances match an independent matrix-square-root computation", "[eval]") {
  torch::manual_seed(2);
  for (int64_t d : {2, 5, 16}) {
    INFO("D = " << d);
    auto a = random_spd(d, 1.0), b = random_spd(d, 3.0);
    auto ma = torch::randn({d}, f64()), mb = torch::randn({d}, f64());
    const double independent = (ma - mb).pow(2).sum().item<double>() + a.trace().item<double>() +
                               b.trace().item<double>() - 2.0 * trace_sqrt_product(a, b);
    CHECK(frechet_distance(exact(ma, a), exact(mb, b)) == Approx(independent).epsilon(1e-9));
  }
  // 2 x 2 closed form: Tr sqrt(M) = sqrt(tr M + 2 sqrt(det M)) for M similar to a PSD matrix.
  auto a = torch::tensor({{2.0, 0.5}, {0.5, 1.0}}, f64()), b = torch::tensor({{1.0, -0.3}, {-0.3, 3.0}}, f64());
  auto m = a.matmul(b);
  const double tr_sqrt = std::sqrt(m.trace().item<double>() + 2 * std::sqrt(torch::det(m).item<double>()));
  const double closed = a.trace().item<double>() + b.trace().item<double>() - 2 * tr_sqrt;
  CHECK(frechet_distance(exact(torch::zeros({2}, f64()), a), exact(torch::zeros({2}, f64()), b)) ==
        Approx(closed).epsilon(1e-12));
}

TEST_CASE("fid: fitted from samples; rises with added noise; KID agrees", "[eval]") {
  torch::manual_seed(3);
  auto base = torch::randn({4000, 8}, f64()).matmul(torch::randn({8, 8}, f64()));
  auto fit = fit_gaussian(base);
  CHECK(test::relative_error(fit.mean, base.mean(0)) < 1e-12);
  auto centred = base - base.mean(0);
  CHECK(test::relative_error(fit.covariance, centred.t().matmul(centred) / 3999.0) < 1e-12);
  double previous = frechet_distance(fit, fit_gaussian(base));
  CHECK(std::abs(previous) < 1e-9);
  for (double noise : {0.1, 0.5, 1.5}) {
    INFO("noise " << noise);
    auto noisy = base + noise * torch::randn_like(base);
    const double fid = frechet_distance(fit, fit_gaussian(noisy));
    CHECK(fid > previous);
    previous = fid;
  }
  auto same = kernel_distance(base.narrow(0, 0, 2000), base.narrow(0, 2000, 2000), 20, 500, 1);
  auto different = kernel_distance(base, base + 1.0, 20, 500, 1);
  CHECK(std::abs(same.mean) < 5 * same.stddev + 1e-3);
  CHECK(different.mean > 0);
  CHECK(different.mean > 10 * std::abs(same.mean));
}
