#include "attention/rotary.h"

namespace mhla {

torch::Tensor apply_rotary(const torch::Tensor& x, int64_t first_position, double base) {
  const auto t = x.size(1), d = x.size(3), half = d / 2;
  TORCH_CHECK(d % 2 == 0, "rotary embedding needs an even head dimension");
  auto f32 = torch::TensorOptions().dtype(torch::kFloat32).device(x.device());
  auto inv_freq = torch::pow(base, -torch::arange(0, half, f32) * 2.0 / static_cast<double>(d));
  auto angles = torch::arange(first_position, first_position + t, f32).unsqueeze(1) * inv_freq;
  auto cos = angles.cos().view({1, t, 1, half}), sin = angles.sin().view({1, t, 1, half});
  auto xf = x.to(torch::kFloat32);
  auto x1 = xf.narrow(-1, 0, half), x2 = xf.narrow(-1, half, half);
  return torch::cat({x1 * cos - x2 * sin, x2 * cos + x1 * sin}, -1).to(x.scalar_type());
}

}  // namespace mhla
