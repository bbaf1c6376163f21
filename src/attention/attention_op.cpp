#include "attention/attention_op.h"

namespace mhla {

torch::Tensor feature_map(const torch::Tensor& x) {
  auto normed = x * torch::rsqrt(x.pow(2).mean(-1, /*keepdim=*/true) + kFeatureNormEps);
  return torch::relu(normed) + kFeatureFloor;
}

torch::ScalarType reference_compute_dtype(const torch::Tensor& x) {
  return x.scalar_type() == torch::kFloat64 ? torch::kFloat64 : torch::kFloat32;
}

}  // namespace mhla
