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

TEST_CASE("attention: the fused q/k/v rotary split equals unbind + the reference rotation",
          "[attention][gpu]") {
  if (!torch::cuda::is_available()) {
    WARN("no CUDA device: skipped");
    return;
  }
  const auto reference_split = [](const torch::Tensor& qkv, int64_t first) {
    auto parts = qkv.unbind(2);
    return std::array<torch::Tensor, 3>{apply_rotary_reference(parts[0], first),
                                        apply_rotary_reference(parts[1], first), parts[2]};
  };
  // Head dims on the 16-byte path (64, 128) and off it (6: half = 3), a strided projection
  // (a narrow of a wider buffer), decode-style single tokens at a late position.
  struct Case {
    std::vector<int64_t> shape;
    int64_t first;
    bool strided;
  };
  const std::vector<Case> cases = {{{2, 67, 3, 4, 64}, 0, false},
                                   {{1, 33, 3, 2, 128}, 0, true},
                                   {{3, 5, 3, 2, 6}, 0, false},
                                   {{4, 1, 3, 8, 64}, 1000, false}};
  for (auto dtype : {torch::kFloat32, torch::kBFloat16, torch::kFloat16}) {
    for (const auto& c : cases) {
      INFO("dtype " << dtype << ", head dim " << c.shape[4] << ", first " << c.first
                    << (c.strided ? ", strided" : ""));
      torch::manual_seed(5);
      auto opts = torch::TensorOptions().device(torch::kCUDA).dtype(dtype);
      auto shape = c.shape;
      if (c.strided) shape[4] += 8;
      auto base = torch::randn(shape, opts);
      auto qkv_a = (c.strided ? base.narrow(4, 0, c.shape[4]) : base).detach().requires_grad_(true);
      auto qkv_b = qkv_a.detach().clone().requires_grad_(true);
      auto ours = split_rotary_qkv(qkv_a, c.first);
      auto theirs = reference_split(qkv_b, c.first);
      const double tolerance = dtype == torch::kFloat32 ? 1e-6 : 4e-3;
      torch::Tensor loss_a = torch::zeros({}, opts.dtype(torch::kFloat32));
      torch::Tensor loss_b = torch::zeros({}, opts.dtype(torch::kFloat32));
      for (int p = 0; p < 3; ++p) {
        REQUIRE(ours[p].scalar_type() == dtype);
        REQUIRE(ours[p].sizes() == theirs[p].sizes());
        CHECK(test::relative_error(ours[p].to(torch::kFloat32).cpu(),
                                   theirs[p].to(torch::kFloat32).cpu()) < tolerance);
        auto upstream = torch::randn(ours[p].sizes(), opts);
        loss_a = loss_a + (ours[p] * upstream).sum().to(torch::kFloat32);
        loss_b = loss_b + (theirs[p] * upstream).sum().to(torch::kFloat32);
      }
      REQUIRE(ours[0].grad_fn() != nullptr);
      CHECK(ours[0].grad_fn()->name().find("SplitQkvFunction") != std::string::npos);
      loss_a.backward();
      loss_b.backward();
      CHECK(test::relative_error(qkv_a.grad().to(torch::kFloat32).cpu(),
                                 qkv_b.grad().to(torch::kFloat32).cpu()) < tolerance);
    }
  }
  SECTION("an output without a gradient, and second-order gradients") {
    auto opts = torch::TensorOptions().device(torch::kCUDA);
    auto qkv_a = torch::randn({2, 9, 3, 2, 64}, opts).requires_grad_(true);
    auto qkv_b = qkv_a.detach().clone().requires_grad_(true);
    // Only q and k used (v's gradient is zero).
    auto a = split_rotary_qkv(qkv_a, 3);
    auto b = reference_split(qkv_b, 3);
    auto ga = torch::autograd::grad({(a[0] * a[1]).pow(2).sum()}, {qkv_a}, {}, true, true)[0];
    auto gb = torch::autograd::grad({(b[0] * b[1]).pow(2).sum()}, {qkv_b}, {}, true, true)[0];
    CHECK(test::relative_error(ga.cpu(), gb.cpu()) < 1e-5);
    CHECK(ga.select(2, 2).abs().max().item<double>() == 0.0);
    ga.pow(2).sum().backward();
    gb.pow(2).sum().backward();
    CHECK(test::relative_error(qkv_a.grad().cpu(), qkv_b.grad().cpu()) < 1e-5);
  }
}

TEST_CASE("attention: the q/k/v rotary split on the CPU is unbind + the reference rotation",
          "[attention]") {
  auto qkv = torch::randn({2, 7, 3, 2, 8}, torch::kFloat64);
  auto parts = split_rotary_qkv(qkv, 4);
  CHECK(torch::equal(parts[0], apply_rotary_reference(qkv.select(2, 0), 4)));
  CHECK(torch::equal(parts[1], apply_rotary_reference(qkv.select(2, 1), 4)));
  CHECK(torch::equal(parts[2], qkv.select(2, 2)));
  CHECK_THROWS(split_rotary_qkv(torch::zeros({2, 7, 2, 2, 8})));
  CHECK_THROWS(split_rotary_qkv(torch::zeros({2, 7, 3, 2, 7})));
}
