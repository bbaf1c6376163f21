// The GELU MLP (models/gelu_mlp.h): both GELU forms against their written-out formulas on the CPU;
// on the GPU the fused cuBLASLt products (tanh form) against float64 torch, values and all five
// gradients, and a check of which GELU form the library's epilogue computes.
#include <cmath>

#include "catch_compat.h"
#include "core/config.h"
#include "core/device.h"
#include "models/gelu_mlp.h"
#include "models/transformer_block.h"
#include "test_helpers.h"

using namespace mhla;

namespace {

torch::Tensor f64cpu(const torch::Tensor& t) {
  return t.to(torch::kCPU, torch::kFloat64);
}

torch::Tensor gelu_tanh_formula(const torch::Tensor& x) {
  return 0.5 * x * (1 + torch::tanh(std::sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x)));
}

torch::Tensor gelu_erf_formula(const torch::Tensor& x) {
  return 0.5 * x * (1 + torch::erf(x / std::sqrt(2.0)));
}

// fc2(gelu(fc1(x))) in float64 torch ops with the formula written out.
torch::Tensor mlp_formula(const torch::Tensor& x, const torch::Tensor& w1, const torch::Tensor& b1,
                          const torch::Tensor& w2, const torch::Tensor& b2, GeluForm form) {
  auto pre = torch::matmul(x, w1.t()) + b1;
  auto h = form == GeluForm::tanh ? gelu_tanh_formula(pre) : gelu_erf_formula(pre);
  return torch::matmul(h, w2.t()) + b2;
}

struct MlpWeights {
  torch::Tensor w1, b1, w2, b2;
};

MlpWeights random_weights(int64_t in, int64_t hidden, int64_t out,
                          const torch::TensorOptions& options) {
  // Scaled so the pre-activations are O(1): both GELU forms differ most there.
  return {(torch::randn({hidden, in}, options) / std::sqrt(in)).requires_grad_(true),
          (torch::randn({hidden}, options) * 0.5).requires_grad_(true),
          (torch::randn({out, hidden}, options) / std::sqrt(hidden)).requires_grad_(true),
          (torch::randn({out}, options) * 0.5).requires_grad_(true)};
}

}  // namespace

TEST_CASE("layers: the GELU MLP on the CPU is fc2(gelu(fc1 x)) in either GELU form", "[model]") {
  torch::manual_seed(3);
  auto f64 = torch::TensorOptions().dtype(torch::kFloat64);
  auto x = torch::randn({2, 5, 16}, f64).requires_grad_(true);
  auto w = random_weights(16, 40, 12, f64);
  for (GeluForm form : {GeluForm::exact, GeluForm::tanh}) {
    INFO((form == GeluForm::tanh ? "tanh" : "exact"));
    CHECK_FALSE(gelu_mlp_fuses(x, w.w1, w.b1, w.w2, w.b2, form));
    auto out = gelu_mlp(x, w.w1, w.b1, w.w2, w.b2, form);
    CHECK(out.sizes() == torch::IntArrayRef({2, 5, 12}));
    CHECK(test::relative_error(out, mlp_formula(x, w.w1, w.b1, w.w2, w.b2, form)) < 1e-12);
  }
  // The two forms are different functions: about 1e-4 apart at O(1) pre-activations.
  auto exact = gelu_mlp(x, w.w1, w.b1, w.w2, w.b2, GeluForm::exact);
  auto tanh = gelu_mlp(x, w.w1, w.b1, w.w2, w.b2, GeluForm::tanh);
  const double apart = test::relative_error(tanh, exact);
  CHECK(apart > 1e-6);
  CHECK(apart < 1e-2);

  // The module and the config key.
  Mlp mlp(16, 40, true, GeluForm::tanh);
  auto p = mlp->named_parameters();
  CHECK(test::relative_error(
            mlp->forward(x.to(torch::kFloat32)).to(torch::kFloat64),
            mlp_formula(x, p["fc1.weight"].to(torch::kFloat64), p["fc1.bias"].to(torch::kFloat64),
                        p["fc2.weight"].to(torch::kFloat64), p["fc2.bias"].to(torch::kFloat64),
                        GeluForm::tanh)) < 1e-5);
  CHECK(mlp_kind("gelu_tanh") == MlpKind::gelu_tanh);
  CHECK(test::contains(test::error_of([] { mlp_kind("relu"); }), "unknown MLP kind 'relu'"));
}

TEST_CASE("config: model.mlp takes the GELU forms, SwiGLU only for language models", "[config]") {
  auto dit = parse_config("model:\n  name: dit\n  mlp: gelu_tanh\n", "dit.yaml", {});
  CHECK(dit.model.mlp == "gelu_tanh");
  CHECK(test::contains(
      test::error_of([] { parse_config("model:\n  name: dit\n  mlp: swiglu\n", "dit.yaml", {}); }),
      "model.mlp = swiglu is for language models"));
  CHECK(test::contains(
      test::error_of([] { parse_config("model:\n  mlp: relu\n", "deit.yaml", {}); }), "model.mlp"));
}

TEST_CASE("layers: the fused GELU MLP products match float64 torch, values and gradients",
          "[model][gpu]") {
  if (!torch::cuda::is_available()) {
    WARN("no CUDA device: skipped");
    return;
  }
  const auto cuda = torch::Device(torch::kCUDA);
  const auto f32 = torch::TensorOptions().device(cuda);

  SECTION("the epilogue's GELU is the tanh form") {
    // fp32 products (no TF32 in the fused path), inference: the two forms are ~1e-4 apart, the
    // products' rounding ~1e-6.
    torch::manual_seed(7);
    torch::NoGradGuard no_grad;
    auto x = torch::randn({4, 64, 128}, f32);
    auto w = random_weights(128, 512, 128, f32);
    REQUIRE(gelu_mlp_fuses(x, w.w1, w.b1, w.w2, w.b2, GeluForm::tanh));
    auto out = f64cpu(gelu_mlp(x, w.w1, w.b1, w.w2, w.b2, GeluForm::tanh));
    auto args = std::vector<torch::Tensor>{f64cpu(x), f64cpu(w.w1), f64cpu(w.b1), f64cpu(w.w2),
                                           f64cpu(w.b2)};
    const double to_tanh = test::relative_error(
        out, mlp_formula(args[0], args[1], args[2], args[3], args[4], GeluForm::tanh));
    const double to_erf = test::relative_error(
        out, mlp_formula(args[0], args[1], args[2], args[3], args[4], GeluForm::exact));
    INFO("relative error against the tanh form " << to_tanh << ", against erf " << to_erf);
    CHECK(to_tanh < 2e-5);
    CHECK(to_erf > 5 * to_tanh);
  }

  SECTION("training: output and the gradients of x, W1, b1, W2, b2") {
    struct Shape {
      int64_t batch, tokens, in, hidden, out;
    };
    // DiT-S's MLP (384 -> 1,536 -> 384) at 256 tokens, a small one with a token count that is
    // no multiple of anything, a single token, a narrower output than input.
    // Both forms: tanh fused into the products, erf's backward in one pass with the bias sum.
    for (Shape s : {Shape{2, 256, 384, 1536, 384}, Shape{3, 37, 64, 256, 64},
                    Shape{1, 1, 32, 128, 32}, Shape{2, 19, 128, 512, 48}}) {
      for (auto [bf16, form] :
           {std::pair{true, GeluForm::tanh}, std::pair{false, GeluForm::tanh},
            std::pair{true, GeluForm::exact}, std::pair{false, GeluForm::exact}}) {
        INFO("B " << s.batch << " N " << s.tokens << " " << s.in << " -> " << s.hidden << " -> "
                  << s.out << (bf16 ? ", bf16 autocast" : ", fp32")
                  << (form == GeluForm::tanh ? ", tanh" : ", erf"));
        torch::manual_seed(s.tokens + s.hidden);
        auto x = torch::randn({s.batch, s.tokens, s.in}, f32).requires_grad_(true);
        auto w = random_weights(s.in, s.hidden, s.out, f32);
        REQUIRE(gelu_mlp_fuses(x, w.w1, w.b1, w.w2, w.b2, form));
        torch::Tensor out;
        {
          AutocastScope autocast(cuda, bf16);
          out = gelu_mlp(x, w.w1, w.b1, w.w2, w.b2, form);
        }
        REQUIRE(out.grad_fn() != nullptr);
        CHECK(out.grad_fn()->name().find("FusedGeluMlpFunction") != std::string::npos);
        CHECK(out.scalar_type() == (bf16 ? torch::kBFloat16 : torch::kFloat32));
        auto up = torch::randn(out.sizes(), f32);
        (out.to(torch::kFloat32) * up).sum().backward();

        auto x64 = f64cpu(x).detach().requires_grad_(true);
        MlpWeights w64{
            f64cpu(w.w1).detach().requires_grad_(true), f64cpu(w.b1).detach().requires_grad_(true),
            f64cpu(w.w2).detach().requires_grad_(true), f64cpu(w.b2).detach().requires_grad_(true)};
        auto expected = mlp_formula(x64, w64.w1, w64.b1, w64.w2, w64.b2, form);
        (expected * f64cpu(up)).sum().backward();

        // bf16: the products' inputs and the hidden activation are rounded to 8 bits of
        // mantissa (about 4e-3 relative each); fp32: the products' rounding only.
        const double value_tol = bf16 ? 1e-2 : 1e-5, grad_tol = bf16 ? 2e-2 : 1e-4;
        CHECK(test::relative_error(f64cpu(out), expected.detach()) < value_tol);
        CHECK(x.grad().scalar_type() == torch::kFloat32);
        CHECK(w.b1.grad().scalar_type() == torch::kFloat32);
        CHECK(test::relative_error(f64cpu(x.grad()), x64.grad()) < grad_tol);
        CHECK(test::relative_error(f64cpu(w.w1.grad()), w64.w1.grad()) < grad_tol);
        CHECK(test::relative_error(f64cpu(w.b1.grad()), w64.b1.grad()) < grad_tol);
        CHECK(test::relative_error(f64cpu(w.w2.grad()), w64.w2.grad()) < grad_tol);
        CHECK(test::relative_error(f64cpu(w.b2.grad()), w64.b2.grad()) < grad_tol);
      }
    }
  }

  SECTION("sizes the products do not take fall back to the torch ops") {
    torch::manual_seed(11);
    auto x = torch::randn({2, 9, 36}, f32).requires_grad_(true);  // 36: not a multiple of 8
    auto w = random_weights(36, 144, 36, f32);
    CHECK_FALSE(gelu_mlp_fuses(x, w.w1, w.b1, w.w2, w.b2, GeluForm::tanh));
    CHECK_FALSE(gelu_mlp_fuses(x, w.w1, w.b1, w.w2, w.b2, GeluForm::exact));
    auto out = gelu_mlp(x, w.w1, w.b1, w.w2, w.b2, GeluForm::tanh);
    CHECK(test::relative_error(f64cpu(out),
                               mlp_formula(f64cpu(x), f64cpu(w.w1), f64cpu(w.b1), f64cpu(w.w2),
                                           f64cpu(w.b2), GeluForm::tanh)) < 1e-5);
  }
}
