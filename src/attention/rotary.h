#pragma once
// Rotary position embedding (half-split form): for x [B, T, H, D] and positions t,
// x' = [x1 cos - x2 sin, x2 cos + x1 sin] with x1, x2 the two halves of D and angles
// t * base^(-2i / D).
#include <torch/torch.h>

namespace mhla {

torch::Tensor apply_rotary(const torch::Tensor& x, int64_t first_position = 0, double base = 10000.0);

}  // namespace mhla
