#pragma once
// Distances between two sets of feature vectors, as FID and KID compute them, in float64.
// FID here is a Fréchet distance on features of a network the framework trains itself: report it
// as "FID-FMNIST (own feature network)", never as Inception FID.
#include <torch/torch.h>

namespace mhla {

struct GaussianFit {
  torch::Tensor mean;        // [D] float64
  torch::Tensor covariance;  // [D, D] float64 (unbiased, divides by n - 1)
  int64_t count = 0;
};

// Mean and covariance of features [n, D] (n >= 2), accumulated in float64.
GaussianFit fit_gaussian(const torch::Tensor& features);

// ||m1 - m2||^2 + Tr(S1 + S2 - 2 (S1^1/2 S2 S1^1/2)^1/2), with the square roots taken through
// symmetric eigen-decompositions (negative rounding-level eigenvalues clamped to zero).
double frechet_distance(const GaussianFit& a, const GaussianFit& b);

// Kernel inception distance: the unbiased MMD^2 with the cubic polynomial kernel
// k(x, y) = (x.y / D + 1)^3, averaged over `subsets` random subsets of `subset_size` per set.
struct KidResult {
  double mean = 0.0, stddev = 0.0;
};
KidResult kernel_distance(const torch::Tensor& a, const torch::Tensor& b, int64_t subsets = 100,
                          int64_t subset_size = 1000, uint64_t seed = 0);

}  // namespace mhla
