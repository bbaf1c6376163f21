// The fused residual add + LayerNorm between two pre-norm branches (models/residual_norm.h): on the
// CPU it is residual_add then the norm; the CUDA kernel is checked against the float64 formula,
// values and every gradient; a block chain through forward_normed equals plain forward.
#include "attention/attention_type.h"
#include "catch_compat.h"
#include "core/config.h"
#include "core/device.h"
#include "models/residual_add.h"
#include "models/residual_norm.h"
#include "models/transformer_block.h"
#include "test_helpers.h"

using namespace mhla;

namespace {

torch::Tensor f64cpu(const torch::Tensor& t) {
  return t.to(torch::kCPU, torch::kFloat64);
}

}  // namespace

TEST_CASE("layers: residual add + norm on the CPU is residual_add then the norm", "[model]") {
  LayerNorm norm(24);
  {
    torch::NoGradGuard no_grad;
    norm->weight.uniform_(0.5, 1.5);
    norm->bias.uniform_(-0.5, 0.5);
  }
  auto x = torch::randn({4, 5, 24});
  auto branch = torch::randn({4, 5, 24});
  torch::manual_seed(9);
  auto fused = residual_add_norm(x, branch, 0.5, true, *norm);
  torch::manual_seed(9);
  auto sum = residual_add(x, branch, 0.5, true);
  CHECK(torch::equal(fused.sum, sum));
  CHECK(torch::equal(fused.normed, norm->forward(sum)));
  CHECK_THROWS(residual_add_norm(x, torch::randn({4, 5, 23}), 0.0, false, *norm));
  CHECK_THROWS(
      residual_add_norm(torch::randn({4, 5, 23}), torch::randn({4, 5, 23}), 0.0, false, *norm));
}

TEST_CASE("layers: a block chain through forward_normed equals forward then the next norm",
          "[model]") {
  auto config = parse_config("", "t.yaml", {"attention.type=softmax"});
  const auto& type = attention_registry().get("softmax");
  AttentionSpec spec;
  spec.dim = 16, spec.heads = 2, spec.layout = TokenLayout{1, 6, 1, 1};
  spec.config = config.attention;
  spec.config.type = "softmax";
  spec.where = "test";
  TransformerBlock block(type.make_layer(spec, type), 16, 32, 0.3);
  LayerNorm next(16);
  {
    torch::NoGradGuard no_grad;
    next->weight.uniform_(0.5, 1.5);
  }
  auto x = torch::randn({3, 6, 16});
  for (bool training : {false, true}) {
    block->train(training);
    torch::manual_seed(4);
    auto [out, normed] = block->forward_normed(x, block->norm1().forward(x), *next);
    torch::manual_seed(4);
    auto expected = block->forward(x);
    CHECK(test::relative_error(out, expected) < 1e-6);
    CHECK(test::relative_error(normed, next->forward(expected)) < 1e-6);
  }
}

TEST_CASE("layers: the residual add + norm kernel matches float64 torch, values and gradients",
          "[model][gpu]") {
  if (!torch::cuda::is_available()) {
    WARN("no CUDA device: skipped");
    return;
  }
  const auto cuda = torch::Device(torch::kCUDA);
  const auto f32 = torch::TensorOptions().device(cuda);
  // Widths of DeiT-T (192), the GPT (512), the widest kernel row (1024) and one off the 4-wide
  // path (130); an fp32 branch without autocast and a bf16 branch under autocast; with and without
  // stochastic depth; with and without a gradient arriving for the sum.
  for (int64_t width : {192, 512, 1024, 130}) {
    for (bool bf16 : {true, false}) {
      for (bool drop : {false, true}) {
        for (bool sum_used : {true, false}) {
          INFO("width " << width << (bf16 ? ", bf16 branch" : ", fp32 branch")
                        << (drop ? ", drop path" : "") << (sum_used ? ", sum used" : ""));
          torch::manual_seed(width);
          const auto branch_type = bf16 ? torch::kBFloat16 : torch::kFloat32;
          LayerNorm norm(width);
          norm->to(cuda);
          {
            torch::NoGradGuard no_grad;
            norm->weight.uniform_(0.5, 1.5);
            norm->bias.uniform_(-0.5, 0.5);
          }
          auto x = (torch::randn({6, 37, width}, f32) * 2 + 1).requires_grad_(true);
          auto branch = torch::randn({6, 37, width}, f32).to(branch_type).requires_grad_(true);
          auto scale = drop ? drop_path_scale(6, 0.4, true, cuda) : torch::Tensor();
          ResidualNorm out;
          {
            AutocastScope autocast(cuda, bf16);
            out = residual_add_norm_with_scale(x, branch, scale, *norm);
          }
          REQUIRE(out.sum.grad_fn() != nullptr);
          CHECK(out.sum.grad_fn()->name().find("ResidualNormFunction") != std::string::npos);
          CHECK(out.sum.scalar_type() == torch::kFloat32);
          CHECK(out.normed.scalar_type() == branch_type);
          auto up_sum = torch::randn(out.sum.sizes(), f32);
          auto up_normed = torch::randn(out.sum.sizes(), f32).to(branch_type);
          auto loss = (out.normed * up_normed).sum().to(torch::kFloat32);
          if (sum_used) loss = loss + (out.sum * up_sum).sum();
          loss.backward();

          // float64 reference on the CPU, from the same inputs.
          auto x64 = f64cpu(x).detach().requires_grad_(true);
          auto b64 = f64cpu(branch).detach().requires_grad_(true);
          auto w64 = f64cpu(norm->weight).detach().requires_grad_(true);
          auto bias64 = f64cpu(norm->bias).detach().requires_grad_(true);
          auto sum64 = drop ? x64 + b64 * f64cpu(scale).view({6, 1, 1}) : x64 + b64;
          auto normed64 = torch::layer_norm(sum64, {width}, w64, bias64, norm->eps());
          auto loss64 = (normed64 * f64cpu(up_normed)).sum();
          if (sum_used) loss64 = loss64 + (sum64 * f64cpu(up_sum)).sum();
          loss64.backward();

          const double out_tol = bf16 ? 5e-3 : 1e-5;
          CHECK(test::relative_error(f64cpu(out.sum), sum64.detach()) < 1e-6);
          CHECK(test::relative_error(f64cpu(out.normed), normed64.detach()) < out_tol);
          CHECK(test::relative_error(f64cpu(x.grad()), x64.grad()) < 1e-4);
          CHECK(branch.grad().scalar_type() == branch_type);
          CHECK(test::relative_error(f64cpu(branch.grad()), b64.grad()) < out_tol);
          CHECK(test::relative_error(f64cpu(norm->weight.grad()), w64.grad()) < 1e-4);
          CHECK(test::relative_error(f64cpu(norm->bias.grad()), bias64.grad()) < 1e-4);
        }
      }
    }
  }
}
