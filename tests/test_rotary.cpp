#include "attention/rotary.h"
#include "catch_compat.h"
#include "test_helpers.h"

using namespace mhla;

TEST_CASE("attention: rotary embedding keeps norms and makes q.k depend on relative position only", "[attention]") {
  // The rotation is computed in fp32 (also for fp64 inputs): tolerances at fp32 rounding.
  torch::manual_seed(3);
  auto q = torch::randn({1, 1, 2, 16}, torch::kFloat64);
  auto k = torch::randn({1, 1, 2, 16}, torch::kFloat64);
  auto dot = [&](int64_t pq, int64_t pk) {
    return (apply_rotary_reference(q, pq) * apply_rotary_reference(k, pk)).sum().item<double>();
  };
  CHECK(dot(7, 3) == Approx(dot(104, 100)).epsilon(1e-6));
  CHECK(dot(0, 0) == Approx((q * k).sum().item<double>()).epsilon(1e-6));
  CHECK(dot(5, 0) != Approx(dot(0, 0)).epsilon(1e-3));
  // Each (x_i, x_{i + D/2}) pair is rotated: its norm is unchanged.
  auto rotated = apply_rotary_reference(q, 37);
  auto pair_norms = [](const torch::Tensor& x) {
    return x.narrow(-1, 0, 8).pow(2) + x.narrow(-1, 8, 8).pow(2);
  };
  CHECK(test::relative_error(pair_norms(rotated), pair_norms(q)) < 1e-6);
  CHECK(torch::equal(apply_rotary(q, 37), rotated));  // the CPU path is the reference
  CHECK_THROWS(apply_rotary(torch::zeros({1, 2, 1, 7})));
}

TEST_CASE("attention: the rotary kernel equals the reference rotation, values and gradients", "[attention][gpu]") {
  if (!torch::cuda::is_available()) {
    WARN("no CUDA device: skipped");
    return;
  }
  for (auto dtype : {torch::kFloat32, torch::kBFloat16, torch::kFloat16}) {
    for (int64_t first : {0, 1000}) {
      INFO("dtype " << dtype << ", first position " << first);
      torch::manual_seed(11);
      auto opts = torch::TensorOptions().device(torch::kCUDA).dtype(dtype);
      // q as the attention layer sees it: a strided view into the fused [B, T, 3, H, D] projection.
      auto qkv_a = torch::randn({2, 67, 3, 3, 64}, opts).requires_grad_(true);
      auto qkv_b = qkv_a.detach().clone().requires_grad_(true);
      auto kernel = apply_rotary(qkv_a.select(2, 0), first);
      auto reference = apply_rotary_reference(qkv_b.select(2, 0), first);
      REQUIRE(kernel.scalar_type() == dtype);
      // The kernel ran (not a silent fallback to the reference form).
      REQUIRE(kernel.grad_fn() != nullptr);
      CHECK(kernel.grad_fn()->name().find("RotaryFunction") != std::string::npos);
      const double tolerance = dtype == torch::kFloat32 ? 1e-6 : 4e-3;
      CHECK(test::relative_error(kernel.to(torch::kFloat32).cpu(), reference.to(torch::kFloat32).cpu()) < tolerance);
      auto upstream = torch::randn(kernel.sizes(), opts);
      (kernel * upstream).sum().backward();
      (reference * upstream).sum().backward();
      CHECK(test::relative_error(qkv_a.grad().to(torch::kFloat32).cpu(), qkv_b.grad().to(torch::kFloat32).cpu()) < tolerance);
      // Only the q slice receives a gradient.
      CHECK(qkv_a.grad().select(2, 1).abs().max().item<double>() == 0.0);
      // The backward is itself differentiable: a second-order gradient matches the reference's.
      if (dtype == torch::kFloat32) {
        auto xa = torch::randn({2, 9, 3, 64}, opts).requires_grad_(true);
        auto xb = xa.detach().clone().requires_grad_(true);
        auto first_a = torch::autograd::grad({apply_rotary(xa, first).pow(3).sum()}, {xa}, {}, true, true)[0];
        auto first_b = torch::autograd::grad({apply_rotary_reference(xb, first).pow(3).sum()}, {xb}, {}, true, true)[0];
        first_a.sum().backward();
        first_b.sum().backward();
        CHECK(test::relative_error(xa.grad().cpu(), xb.grad().cpu()) < 1e-5);
      }
    }
  }
}
