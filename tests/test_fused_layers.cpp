// The LayerNorm and residual-add layers every model uses: the CPU path is torch's formula, the
// CUDA kernels (kernels/layer_norm, kernels/residual_add) are checked against it in float64.
#include "catch_compat.h"
#include "core/device.h"
#include "models/layer_norm.h"
#include "models/linear.h"
#include "models/residual_add.h"
#include "test_helpers.h"

using namespace mhla;

namespace {

// Output and x, weight, bias gradients of one layer norm call under a fixed upstream gradient.
struct NormResult {
  torch::Tensor y, dx, dweight, dbias;
};

NormResult run_norm(const torch::Tensor& x0, const torch::Tensor& w0, const torch::Tensor& b0,
                    const torch::Tensor& upstream, bool kernel_form) {
  auto x = x0.detach().clone().requires_grad_(true);
  torch::Tensor w, b;
  if (w0.defined()) {
    w = w0.detach().clone().requires_grad_(true);
    b = b0.detach().clone().requires_grad_(true);
  }
  auto y = kernel_form ? layer_norm(x, w, b, 1e-5) : torch::layer_norm(x, {x.size(-1)}, w, b, 1e-5);
  (y.to(upstream.scalar_type()) * upstream).sum().backward();
  NormResult r{y.detach(), x.grad()};
  if (w.defined()) r.dweight = w.grad(), r.dbias = b.grad();
  return r;
}

torch::Tensor f64cpu(const torch::Tensor& t) {
  return t.to(torch::kCPU, torch::kFloat64);
}

}  // namespace

TEST_CASE("layers: LayerNorm on the CPU is torch's layer norm and keeps torch's parameter names",
          "[model]") {
  torch::manual_seed(2);
  LayerNorm norm(12);
  auto named = norm->named_parameters();
  REQUIRE(named.size() == 2);
  CHECK(named.contains("weight"));
  CHECK(named.contains("bias"));
  norm->weight.data().uniform_(0.5, 1.5);
  norm->bias.data().uniform_(-0.5, 0.5);
  auto x = torch::randn({3, 5, 12}, torch::kFloat64);
  auto expected = torch::layer_norm(x, {12}, norm->weight.to(torch::kFloat64),
                                    norm->bias.to(torch::kFloat64), 1e-5);
  norm->to(torch::kFloat64);
  CHECK(test::relative_error(norm(x), expected) < 1e-14);
  CHECK(LayerNorm(12, /*affine=*/false)->named_parameters().size() == 0);
  CHECK(test::contains(test::error_of([&] {
                         norm(torch::randn({2, 11}));
                       }),
                       "last dimension is 11"));
  CHECK(!test::error_of([&] { layer_norm(x, norm->weight, torch::Tensor(), 1e-5); }).empty());
}

TEST_CASE("layers: residual add with stochastic depth scales whole samples", "[model]") {
  torch::manual_seed(4);
  auto x = torch::randn({64, 3, 4});
  auto branch = torch::randn({64, 3, 4});
  // Not training, or rate 0: a plain sum.
  CHECK(torch::equal(residual_add(x, branch, 0.3, false), x + branch));
  CHECK(torch::equal(residual_add(x, branch, 0.0, true), x + branch));
  // Training: each sample's branch is dropped or scaled by 1 / keep, as drawn by drop_path_scale.
  torch::manual_seed(9);
  auto out = residual_add(x, branch, 0.25, true);
  torch::manual_seed(9);
  auto scale = drop_path_scale(64, 0.25, true, torch::kCPU);
  CHECK(torch::allclose(out, residual_add_reference(x, branch, scale)));
  auto dropped = scale.eq(0), kept = scale.sub(1.0 / 0.75).abs().lt(1e-6);
  CHECK(torch::logical_or(dropped, kept).all().item<bool>());
  CHECK(dropped.any().item<bool>());
  CHECK(kept.any().item<bool>());
  CHECK(test::contains(test::error_of([&] { residual_add(x, branch.narrow(1, 0, 2), 0.0, true); }),
                       "differ"));
}

TEST_CASE("layers: the LayerNorm kernels match float64 torch, outputs and gradients",
          "[model][gpu]") {
  if (!torch::cuda::is_available()) {
    WARN("no CUDA device: skipped");
    return;
  }
  const auto cuda = torch::Device(torch::kCUDA);
  // Shapes: vector widths 8/4/2/1 (cols 384, 100, 98, 97), one row, more rows than one pass of
  // the backward's CTAs covers (4,096), the widest row taken (1,024).
  const std::vector<std::pair<int64_t, int64_t>> shapes = {{1, 384},   {3, 97},      {1000, 100},
                                                           {5003, 98}, {10000, 192}, {257, 1024}};
  for (auto dtype : {torch::kFloat32, torch::kBFloat16, torch::kFloat16}) {
    for (auto [rows, cols] : shapes) {
      for (bool affine : {true, false}) {
        INFO("dtype " << dtype << ", rows " << rows << ", cols " << cols << ", affine " << affine);
        torch::manual_seed(rows + cols);
        auto x =
            (torch::randn({rows, cols}, torch::kFloat64) * 3 + 1).to(dtype).to(torch::kFloat64);
        torch::Tensor w, b;
        if (affine) {
          w = torch::rand({cols}, torch::kFloat64) + 0.5;
          b = torch::randn({cols}, torch::kFloat64);
        }
        auto upstream = torch::randn({rows, cols}, torch::kFloat64);
        auto reference = run_norm(x, w, b, upstream, false);
        auto xg = x.to(cuda, dtype);
        auto wg = affine ? w.to(cuda, torch::kFloat32) : torch::Tensor();
        auto bg = affine ? b.to(cuda, torch::kFloat32) : torch::Tensor();
        REQUIRE(layer_norm_uses_kernel(xg, wg));
        auto got = run_norm(xg, wg, bg, upstream.to(cuda, torch::kFloat32), true);
        REQUIRE(got.y.scalar_type() == dtype);
        const double out_tol = dtype == torch::kFloat32 ? 1e-5 : 5e-3;
        const double grad_tol = dtype == torch::kFloat32 ? 1e-5 : 8e-3;
        CHECK(test::relative_error(f64cpu(got.y), reference.y) < out_tol);
        CHECK(test::relative_error(f64cpu(got.dx), reference.dx) < grad_tol);
        if (affine) {
          // fp32 sums; dy itself arrives in the output dtype (rounded for bf16/fp16).
          CHECK(test::relative_error(f64cpu(got.dweight), reference.dweight) < grad_tol);
          CHECK(test::relative_error(f64cpu(got.dbias), reference.dbias) < grad_tol);
        }
      }
    }
  }
  // Under bf16 autocast the output comes out in bf16 (what the next matmul takes), the gradient
  // of the fp32 input stays fp32.
  auto x = torch::randn({4096, 192}, torch::TensorOptions().device(cuda)).requires_grad_(true);
  LayerNorm norm(192);
  norm->to(cuda);
  torch::Tensor y;
  {
    AutocastScope autocast(cuda, true);
    y = norm(x);
  }
  CHECK(y.scalar_type() == torch::kBFloat16);
  REQUIRE(y.grad_fn() != nullptr);
  CHECK(y.grad_fn()->name().find("LayerNormFunction") != std::string::npos);
  y.to(torch::kFloat32).square().sum().backward();
  CHECK(x.grad().scalar_type() == torch::kFloat32);
  auto expected = torch::layer_norm(x.detach().to(torch::kFloat64), {192}, {}, {}, 1e-5);
  CHECK(test::relative_error(f64cpu(y), f64cpu(expected)) < 5e-3);
}

TEST_CASE("layers: the residual-add kernel matches the torch formula, values and gradients",
          "[model][gpu]") {
  if (!torch::cuda::is_available()) {
    WARN("no CUDA device: skipped");
    return;
  }
  const auto cuda = torch::Device(torch::kCUDA);
  // [B, N, C] with N * C a multiple of 4 (vector path) and not (scalar path).
  for (auto shape : {std::vector<int64_t>{32, 256, 192}, std::vector<int64_t>{5, 7, 3}}) {
    for (auto dtype : {torch::kBFloat16, torch::kFloat16, torch::kFloat32}) {
      for (double rate : {0.0, 0.3}) {
        INFO("dtype " << dtype << ", rate " << rate << ", shape " << shape[1] << "x" << shape[2]);
        torch::manual_seed(5);
        auto x = torch::randn(shape, torch::TensorOptions().device(cuda)).requires_grad_(true);
        auto branch =
            torch::randn(shape, torch::TensorOptions().device(cuda)).to(dtype).requires_grad_(true);
        torch::manual_seed(6);
        auto out = residual_add(x, branch, rate, true);
        REQUIRE(out.grad_fn() != nullptr);
        CHECK(out.grad_fn()->name().find("ResidualAddFunction") != std::string::npos);
        CHECK(out.scalar_type() == torch::kFloat32);
        torch::manual_seed(6);
        auto scale = drop_path_scale(shape[0], rate, true, cuda);
        auto expected = residual_add_reference(f64cpu(x), f64cpu(branch),
                                               scale.defined() ? f64cpu(scale) : scale);
        CHECK(test::relative_error(f64cpu(out), expected) < 1e-6);
        auto upstream = torch::randn(shape, torch::TensorOptions().device(cuda));
        (out * upstream).sum().backward();
        CHECK(torch::equal(x.grad(), upstream));
        CHECK(branch.grad().scalar_type() == dtype);
        auto expected_dbranch =
            scale.defined() ? residual_add_reference(torch::zeros_like(upstream), upstream, scale)
                            : upstream;
        const double tol = dtype == torch::kFloat32 ? 1e-6 : 5e-3;
        CHECK(test::relative_error(f64cpu(branch.grad()), f64cpu(expected_dbranch)) < tol);
      }
    }
  }
}

namespace {

struct LinearResult {
  torch::Tensor y, dx, dw, db;
};

// Output and gradients of x W^T + b through torch::linear or our function, under autocast on
// x's device or not.
LinearResult run_linear(const torch::Tensor& x0, const torch::Tensor& w0, const torch::Tensor& b0,
                        const torch::Tensor& upstream, bool own, bool autocast) {
  auto x = x0.detach().clone().requires_grad_(true);
  auto w = w0.detach().clone().requires_grad_(true);
  auto b = b0.detach().clone().requires_grad_(true);
  torch::Tensor y;
  {
    AutocastScope scope(x.device(), autocast);
    y = own ? linear_with_own_backward(x, w, b) : torch::linear(x, w, b);
  }
  (y.to(upstream.scalar_type()) * upstream).sum().backward();
  return {y.detach(), x.grad(), w.grad(), b.grad()};
}

}  // namespace

TEST_CASE(
    "layers: the linear layer's own backward equals torch::linear's, with and without autocast",
    "[model]") {
  torch::manual_seed(8);
  // float64: the same numbers to rounding.
  auto x = torch::randn({3, 5, 7}, torch::kFloat64);
  auto w = torch::randn({4, 7}, torch::kFloat64);
  auto b = torch::randn({4}, torch::kFloat64);
  auto up = torch::randn({3, 5, 4}, torch::kFloat64);
  auto ref = run_linear(x, w, b, up, false, false);
  auto own = run_linear(x, w, b, up, true, false);
  CHECK(test::relative_error(own.y, ref.y) < 1e-14);
  CHECK(test::relative_error(own.dx, ref.dx) < 1e-14);
  CHECK(test::relative_error(own.dw, ref.dw) < 1e-14);
  CHECK(test::relative_error(own.db, ref.db) < 1e-14);
  // bf16 autocast on the CPU, fp32 parameters and input: the output in bf16 as autocast gives
  // it, every gradient back in its tensor's dtype; the bias gradient is summed in fp32 (ATen
  // sums in bf16), so it is compared against float64.
  auto xf = torch::randn({2, 300, 16}), wf = torch::randn({24, 16}) * 0.2, bf = torch::randn({24});
  auto upf = torch::randn({2, 300, 24});
  auto ref_ac = run_linear(xf, wf, bf, upf, false, true);
  auto own_ac = run_linear(xf, wf, bf, upf, true, true);
  CHECK(own_ac.y.scalar_type() == ref_ac.y.scalar_type());
  CHECK(own_ac.dx.scalar_type() == torch::kFloat32);
  CHECK(own_ac.dw.scalar_type() == torch::kFloat32);
  CHECK(own_ac.db.scalar_type() == torch::kFloat32);
  CHECK(test::relative_error(own_ac.y.to(torch::kFloat64), ref_ac.y.to(torch::kFloat64)) < 1e-6);
  CHECK(test::relative_error(own_ac.dx, ref_ac.dx) < 1e-2);
  CHECK(test::relative_error(own_ac.dw, ref_ac.dw) < 1e-2);
  auto exact_db = upf.to(torch::kFloat64).sum(std::vector<int64_t>{0, 1});
  CHECK(test::relative_error(own_ac.db.to(torch::kFloat64), exact_db) < 1e-2);
  CHECK(!test::error_of([&] { linear_with_own_backward(xf, wf, torch::Tensor()); }).empty());
  CHECK(!test::error_of([&] { linear_with_own_backward(xf, wf.narrow(1, 0, 8), bf); }).empty());
}

TEST_CASE("layers: the linear layer's bias-gradient kernel sums columns like float64 torch",
          "[model][gpu]") {
  if (!torch::cuda::is_available()) {
    WARN("no CUDA device: skipped");
    return;
  }
  const auto cuda = torch::Device(torch::kCUDA);
  // Column counts with and without the 4-wide path, a single row, fewer rows than one slab, and
  // the DeiT-T/2 MLP's 65,536 x 768.
  const std::vector<std::pair<int64_t, int64_t>> shapes = {
      {1, 8}, {37, 7}, {1000, 192}, {5003, 130}, {65536, 768}};
  for (auto dtype : {torch::kBFloat16, torch::kFloat16, torch::kFloat32}) {
    for (auto [rows, cols] : shapes) {
      INFO("dtype " << dtype << ", rows " << rows << ", cols " << cols);
      torch::manual_seed(rows + cols);
      auto x = torch::randn({rows, 3, 16}, torch::TensorOptions().device(cuda));
      auto w = (torch::randn({cols, 16}, torch::TensorOptions().device(cuda)) * 0.2);
      auto b = torch::randn({cols}, torch::TensorOptions().device(cuda));
      auto up = torch::randn({rows, 3, cols}, torch::TensorOptions().device(cuda)).to(dtype);
      const bool half = dtype != torch::kFloat32;
      auto own = run_linear(x, w, b, up, true, half);
      // The bias gradient is the fp32 sum of the upstream gradient as the layer saw it (in the
      // output's dtype: bf16 under autocast).
      auto exact_db = up.to(own.y.scalar_type())
                          .to(torch::kCPU, torch::kFloat64)
                          .sum(std::vector<int64_t>{0, 1});
      CHECK(own.db.scalar_type() == torch::kFloat32);
      CHECK(test::relative_error(own.db.to(torch::kCPU, torch::kFloat64), exact_db) < 1e-5);
      auto ref = run_linear(x, w, b, up, false, half);
      CHECK(test::relative_error(f64cpu(own.dx), f64cpu(ref.dx)) < (half ? 1e-2 : 1e-5));
      CHECK(test::relative_error(f64cpu(own.dw), f64cpu(ref.dw)) < (half ? 1e-2 : 1e-5));
    }
  }
}
