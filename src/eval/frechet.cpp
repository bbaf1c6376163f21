#include "eval/frechet.h"

#include <cmath>

#include "core/error.h"

namespace mhla {
namespace {

// The square root of a symmetric positive semi-definite matrix.
torch::Tensor symmetric_sqrt(const torch::Tensor& m) {
  auto [values, vectors] = torch::linalg_eigh(0.5 * (m + m.t()));
  return vectors.matmul(torch::diag(values.clamp_min(0.0).sqrt())).matmul(vectors.t());
}

}  // namespace

GaussianFit fit_gaussian(const torch::Tensor& features) {
  if (features.dim() != 2 || features.size(0) < 2) {
    fail("fit_gaussian: need features [n >= 2, D], got {}", c10::str(features.sizes()));
  }
  auto x = features.to(torch::kCPU, torch::kFloat64);
  GaussianFit fit;
  fit.count = x.size(0);
  fit.mean = x.mean(0);
  auto centred = x - fit.mean;
  fit.covariance = centred.t().matmul(centred) / static_cast<double>(fit.count - 1);
  return fit;
}

double frechet_distance(const GaussianFit& a, const GaussianFit& b) {
  if (a.mean.sizes() != b.mean.sizes()) fail("frechet_distance: feature sizes differ");
  auto mean_term = (a.mean - b.mean).pow(2).sum().item<double>();
  auto root_a = symmetric_sqrt(a.covariance);
  auto middle = root_a.matmul(b.covariance).matmul(root_a);
  auto [values, vectors] = torch::linalg_eigh(0.5 * (middle + middle.t()));
  const double cross = values.clamp_min(0.0).sqrt().sum().item<double>();
  const double trace = a.covariance.trace().item<double>() + b.covariance.trace().item<double>();
  return mean_term + trace - 2.0 * cross;
}

KidResult kernel_distance(const torch::Tensor& a, const torch::Tensor& b, int64_t subsets,
                          int64_t subset_size, uint64_t seed) {
  auto x = a.to(torch::kCPU, torch::kFloat64), y = b.to(torch::kCPU, torch::kFloat64);
  const int64_t m = std::min({subset_size, x.size(0), y.size(0)});
  if (m < 2) fail("kernel_distance: need at least 2 features per set");
  const double d = static_cast<double>(x.size(1));
  auto kernel = [&](const torch::Tensor& p, const torch::Tensor& q) {
    return (p.matmul(q.t()) / d + 1.0).pow(3);
  };
  torch::Generator generator = at::detail::createCPUGenerator(seed);
  std::vector<double> values;
  for (int64_t s = 0; s < subsets; ++s) {
    auto xs = x.index_select(0, torch::randperm(x.size(0), generator, torch::kLong).narrow(0, 0, m));
    auto ys = y.index_select(0, torch::randperm(y.size(0), generator, torch::kLong).narrow(0, 0, m));
    auto kxx = kernel(xs, xs), kyy = kernel(ys, ys), kxy = kernel(xs, ys);
    const double within = ((kxx.sum() - kxx.trace()) + (kyy.sum() - kyy.trace())).item<double>() /
                          static_cast<double>(m * (m - 1));
    values.push_back(within - 2.0 * kxy.mean().item<double>());
  }
  KidResult result;
  for (double v : values) result.mean += v;
  result.mean /= static_cast<double>(values.size());
  for (double v : values) result.stddev += (v - result.mean) * (v - result.mean);
  result.stddev = values.size() > 1 ? std::sqrt(result.stddev / static_cast<double>(values.size() - 1)) : 0.0;
  return result;
}

}  // namespace mhla
