// The adaLN hinge of the DiT blocks (models/adaln.h): on the CPU it is the torch formula; the CUDA
// kernel is checked against the float64 formula, values and every gradient; a DiT on the GPU
// (kernel path) computes what the same DiT computes on the CPU (torch ops).
#include <ATen/Context.h>

#include "catch_compat.h"
#include "core/config.h"
#include "core/device.h"
#include "models/adaln.h"
#include "models/dit.h"
#include "test_helpers.h"

using namespace mhla;

namespace {

torch::Tensor f64cpu(const torch::Tensor& t) {
  return t.to(torch::kCPU, torch::kFloat64);
}

// The hinge in float64 torch ops, written out (not through adaln_hinge_reference).
struct Expected {
  torch::Tensor sum, normed;
};
Expected formula(const torch::Tensor& x, const torch::Tensor& branch, const torch::Tensor& gate,
                 const torch::Tensor& shift, const torch::Tensor& scale, double eps) {
  auto sum = x;
  if (branch.defined()) sum = gate.defined() ? x + gate.unsqueeze(1) * branch : x + branch;
  auto normed = torch::layer_norm(sum, {x.size(2)}, {}, {}, eps);
  return {sum, normed * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)};
}

}  // namespace

TEST_CASE("layers: the adaLN hinge on the CPU is the residual add, the norm and the modulation",
          "[model]") {
  LayerNorm norm(24, /*affine=*/false, 1e-6);
  auto x = torch::randn({3, 5, 24}), branch = torch::randn({3, 5, 24});
  auto gate = torch::randn({3, 24}), shift = torch::randn({3, 24}), scale = torch::randn({3, 24});
  auto out = adaln_hinge(x, branch, gate, shift, scale, *norm);
  auto expected = formula(x, branch, gate, shift, scale, 1e-6);
  CHECK(test::relative_error(out.sum, expected.sum) < 1e-6);
  CHECK(test::relative_error(out.normed, expected.normed) < 1e-5);
  auto first = adaln_hinge(x, {}, {}, shift, scale, *norm);
  CHECK(torch::equal(first.sum, x));
  CHECK(test::relative_error(first.normed, formula(x, {}, {}, shift, scale, 1e-6).normed) < 1e-5);

  CHECK(test::contains(
      test::error_of([&] { adaln_hinge(x, branch, gate, shift, scale.narrow(1, 0, 23), *norm); }),
      "per-sample vectors must be [3, 24]"));
  CHECK(test::contains(
      test::error_of([&] { adaln_hinge(x, branch.narrow(1, 0, 4), gate, shift, scale, *norm); }),
      "branch"));
  CHECK(test::contains(test::error_of([&] {
                         adaln_hinge(x.view({15, 24}), {}, {}, shift, scale, *norm);
                       }),
                       "expected tokens [B, N, C]"));
  LayerNorm wider(32, false, 1e-6);
  CHECK(test::contains(test::error_of([&] { adaln_hinge(x, {}, {}, shift, scale, *wider); }),
                       "the norm normalizes 32"));
}

TEST_CASE("layers: the adaLN hinge kernel matches float64 torch, values and gradients",
          "[model][gpu]") {
  if (!torch::cuda::is_available()) {
    WARN("no CUDA device: skipped");
    return;
  }
  const auto cuda = torch::Device(torch::kCUDA);
  const auto f32 = torch::TensorOptions().device(cuda);
  // DiT-S's width (384) at 256 tokens per sample, a narrow row (64), the widest (1,024), one off
  // the 4-wide path (130), DiT-B's width (768, six chunks), a wide 1-wide row (1,022: the most
  // chunks and more than 48 KB of shared memory); bf16 under autocast and fp32; the first hinge
  // (no branch), gated and ungated residual adds; with and without a gradient for the sum.
  struct Shape {
    int64_t batch, tokens, width;
  };
  for (Shape s : {Shape{4, 256, 384}, Shape{3, 37, 64}, Shape{2, 19, 1024}, Shape{5, 33, 130},
                  Shape{2, 21, 768}, Shape{2, 17, 1022}}) {
    for (bool bf16 : {true, false}) {
      for (int residual : {0, 1, 2}) {  // none, gated, ungated
        for (bool sum_used : {true, false}) {
          if (residual == 0 && !sum_used) continue;
          INFO("B " << s.batch << " N " << s.tokens << " C " << s.width
                    << (bf16 ? ", bf16" : ", fp32") << ", residual " << residual
                    << (sum_used ? ", sum used" : ""));
          torch::manual_seed(s.width + residual);
          const auto branch_type = bf16 ? torch::kBFloat16 : torch::kFloat32;
          LayerNorm norm(s.width, false, 1e-6);
          auto x = (torch::randn({s.batch, s.tokens, s.width}, f32) * 2 + 1).requires_grad_(true);
          auto branch = residual ? torch::randn({s.batch, s.tokens, s.width}, f32)
                                       .to(branch_type)
                                       .requires_grad_(true)
                                 : torch::Tensor();
          // Like the model: views of one [B, 6C] modulation output.
          auto modulation = (torch::randn({s.batch, 6 * s.width}, f32) * 0.5).requires_grad_(true);
          auto m = modulation.chunk(6, 1);
          auto gate = residual == 1 ? m[2] : torch::Tensor();
          AdaLnHinge out;
          {
            AutocastScope autocast(cuda, bf16);
            out = adaln_hinge(x, branch, gate, m[0], m[1], *norm);
          }
          REQUIRE(out.normed.grad_fn() != nullptr);
          CHECK(out.normed.grad_fn()->name().find("AdaLnFunction") != std::string::npos);
          CHECK(out.sum.scalar_type() == torch::kFloat32);
          CHECK(out.normed.scalar_type() == branch_type);
          auto up_sum = torch::randn(x.sizes(), f32);
          auto up_normed = torch::randn(x.sizes(), f32).to(branch_type);
          auto loss = (out.normed * up_normed).sum().to(torch::kFloat32);
          if (sum_used) loss = loss + (out.sum * up_sum).sum();
          loss.backward();

          auto x64 = f64cpu(x).detach().requires_grad_(true);
          auto b64 = residual ? f64cpu(branch).detach().requires_grad_(true) : torch::Tensor();
          auto m64 = f64cpu(modulation).detach().requires_grad_(true);
          auto mm = m64.chunk(6, 1);
          auto expected =
              formula(x64, b64, residual == 1 ? mm[2] : torch::Tensor(), mm[0], mm[1], 1e-6);
          auto loss64 = (expected.normed * f64cpu(up_normed)).sum();
          if (sum_used) loss64 = loss64 + (expected.sum * f64cpu(up_sum)).sum();
          loss64.backward();

          const double tol = bf16 ? 5e-3 : 1e-5;
          CHECK(test::relative_error(f64cpu(out.sum), expected.sum.detach()) <
                (bf16 ? 2e-3 : 1e-6));
          CHECK(test::relative_error(f64cpu(out.normed), expected.normed.detach()) < tol);
          CHECK(test::relative_error(f64cpu(x.grad()), x64.grad()) < (bf16 ? 5e-3 : 1e-4));
          if (residual) {
            CHECK(branch.grad().scalar_type() == branch_type);
            CHECK(test::relative_error(f64cpu(branch.grad()), b64.grad()) < tol);
          }
          // d shift, d scale and (gated) d gate: the per-sample column sums.
          auto dm = f64cpu(modulation.grad()).chunk(6, 1), dm64 = m64.grad().chunk(6, 1);
          for (int k : {0, 1, 2, 3, 4, 5}) {
            INFO("modulation chunk " << k);
            if (k < 2 || (k == 2 && residual == 1)) {
              CHECK(test::relative_error(dm[k], dm64[k]) < (bf16 ? 5e-3 : 1e-4));
            } else {
              CHECK(dm[k].abs().max().item<double>() == 0.0);
            }
          }
        }
      }
    }
  }
}

TEST_CASE("layers: the adaLN hinge kernel takes unaligned rows; empty batches take the torch ops",
          "[model][gpu]") {
  if (!torch::cuda::is_available()) {
    WARN("no CUDA device: skipped");
    return;
  }
  const auto f32 = torch::TensorOptions().device(torch::kCUDA);
  LayerNorm norm(384, false, 1e-6);
  // Every row and vector one float off its 16-byte alignment: the 1-wide path.
  auto shifted = [&](std::vector<int64_t> shape) {
    int64_t n = 1;
    for (auto d : shape) n *= d;
    return torch::randn({n + 1}, f32).narrow(0, 1, n).view(shape).requires_grad_(true);
  };
  auto x = shifted({3, 40, 384}), branch = shifted({3, 40, 384});
  auto gate = shifted({3, 384}), shift = shifted({3, 384}), scale = shifted({3, 384});
  auto out = adaln_hinge(x, branch, gate, shift, scale, *norm);
  REQUIRE(out.normed.grad_fn() != nullptr);
  CHECK(out.normed.grad_fn()->name().find("AdaLnFunction") != std::string::npos);
  auto up = torch::randn({3, 40, 384}, f32);
  auto params = std::vector<torch::Tensor>{x, branch, gate, shift, scale};
  auto grads = torch::autograd::grad({(out.normed * up).sum() + out.sum.sum()}, params);
  auto expected = adaln_hinge_reference(x, branch, gate, shift, scale, *norm);
  auto expected_grads =
      torch::autograd::grad({(expected.normed * up).sum() + expected.sum.sum()}, params);
  CHECK(test::relative_error(out.normed, expected.normed) < 1e-5);
  for (size_t i = 0; i < grads.size(); ++i) {
    INFO("gradient " << i);
    CHECK(test::relative_error(grads[i], expected_grads[i]) < 1e-4);
  }
  for (auto shape : {std::vector<int64_t>{0, 40, 384}, std::vector<int64_t>{3, 0, 384}}) {
    auto empty = torch::zeros(shape, f32);
    auto vectors = torch::zeros({shape[0], 384}, f32);
    auto hinge = adaln_hinge(empty, empty, vectors, vectors, vectors, *norm);
    CHECK(hinge.sum.sizes() == empty.sizes());
    CHECK(hinge.normed.sizes() == empty.sizes());
  }
}

TEST_CASE("layers: the adaLN hinge kernel's gradients are the same bits on every run",
          "[model][gpu]") {
  if (!torch::cuda::is_available()) {
    WARN("no CUDA device: skipped");
    return;
  }
  // Per-sample column sums come from per-CTA partials summed in a fixed order: no atomics, so a
  // resumed run reproduces its gradients exactly.
  const auto f32 = torch::TensorOptions().device(torch::kCUDA);
  LayerNorm norm(384, false, 1e-6);
  torch::manual_seed(5);
  auto x = torch::randn({8, 1024, 384}, f32);
  auto branch = torch::randn({8, 1024, 384}, f32).to(torch::kBFloat16);
  auto modulation = torch::randn({8, 6 * 384}, f32);
  auto up = torch::randn({8, 1024, 384}, f32).to(torch::kBFloat16);
  std::vector<torch::Tensor> grads[2];
  for (auto& run : grads) {
    auto xg = x.clone().requires_grad_(true), bg = branch.clone().requires_grad_(true);
    auto mg = modulation.clone().requires_grad_(true);
    auto m = mg.chunk(6, 1);
    AdaLnHinge out;
    {
      AutocastScope autocast(torch::Device(torch::kCUDA), true);
      out = adaln_hinge(xg, bg, m[2], m[0], m[1], *norm);
    }
    ((out.normed * up).sum().to(torch::kFloat32) + out.sum.sum()).backward();
    run = {xg.grad(), bg.grad(), mg.grad()};
  }
  for (size_t i = 0; i < grads[0].size(); ++i) CHECK(torch::equal(grads[0][i], grads[1][i]));
}

TEST_CASE("dit: the model on the GPU (adaLN hinge kernels) equals the model on the CPU",
          "[model][gpu]") {
  if (!torch::cuda::is_available()) {
    WARN("no CUDA device: skipped");
    return;
  }
  // Both GELU forms: with gelu_tanh the GPU model's MLPs run the fused cuBLASLt products (fp32
  // here), the CPU model's the torch ops.
  for (const char* mlp : {"gelu", "gelu_tanh"}) {
    INFO("model.mlp = " << mlp);
    auto config =
        parse_config("", "dit.yaml",
                     {"model.name=dit", "model.image_size=16", "model.patch_size=2",
                      "model.width=64", "model.depth=3", "model.heads=2", "attention.type=softmax",
                      "train.device=cpu", std::string("model.mlp=") + mlp});
    torch::manual_seed(3);
    Dit cpu_model(config);
    {
      // Leave adaLN-Zero's identity start: every modulation and the final layer get weights.
      torch::NoGradGuard no_grad;
      for (auto& p : cpu_model.parameters()) p.add_(torch::randn_like(p) * 0.05);
    }
    Dit gpu_model(config);
    {
      torch::NoGradGuard no_grad;
      auto from = cpu_model.parameters(), to = gpu_model.parameters();
      for (size_t i = 0; i < from.size(); ++i) to[i].copy_(from[i]);
    }
    gpu_model.to(torch::kCUDA);
    auto x = torch::randn({3, 1, 16, 16});
    auto t = torch::tensor({3, 400, 999}, torch::kLong),
         y = torch::tensor({0, 4, 10}, torch::kLong);
    auto up = torch::randn({3, 1, 16, 16});
    // fp32 on both sides: cuDNN's convolution (the patch embedding) would otherwise use tf32.
    const bool tf32 = at::globalContext().allowTF32CuDNN();
    at::globalContext().setAllowTF32CuDNN(false);
    auto cpu_out = cpu_model.denoise(x, t, y);
    (cpu_out * up).sum().backward();
    auto gpu_out = gpu_model.denoise(x.cuda(), t.cuda(), y.cuda());
    (gpu_out * up.cuda()).sum().backward();
    at::globalContext().setAllowTF32CuDNN(tf32);
    CHECK(test::relative_error(gpu_out.cpu(), cpu_out) < 1e-4);
    auto cpu_params = cpu_model.named_parameters();
    for (const auto& item : gpu_model.named_parameters()) {
      INFO(item.key());
      CHECK(test::relative_error(item.value().grad().cpu(), cpu_params[item.key()].grad()) < 1e-3);
    }
  }
}
