// Causal MHLA's output stage, rms_norm(x) * silu(gate): the ATen reference against the float64
// formula on the CPU, and the CUDA kernel (kernels/gated_rms_norm) against it, values and the
// gradients of x, gate and the norm weight.
#include "attention/gated_rms_norm.h"
#include "catch_compat.h"
#include "test_helpers.h"

using namespace mhla;

namespace {

torch::Tensor f64cpu(const torch::Tensor& t) { return t.to(torch::kCPU, torch::kFloat64); }

// y = x / sqrt(mean(x^2) + eps) * w * g * sigmoid(g), in float64 with autograd.
torch::Tensor exact(const torch::Tensor& x, const torch::Tensor& g, const torch::Tensor& w,
                    double eps) {
  auto rstd = (x.pow(2).mean(-1, /*keepdim=*/true) + eps).rsqrt();
  return x * rstd * w * g * torch::sigmoid(g);
}

struct Grads {
  torch::Tensor y, dx, dg, dw;
};

Grads run(const torch::Tensor& x0, const torch::Tensor& g0, const torch::Tensor& w0,
          const torch::Tensor& up, bool kernel) {
  auto x = x0.detach().clone().requires_grad_(true);
  auto g = g0.detach().clone().requires_grad_(true);
  auto w = w0.detach().clone().requires_grad_(true);
  auto y = kernel ? gated_rms_norm_kernel(x, g, w, 1e-6) : exact(x, g, w, 1e-6);
  (y.to(up.scalar_type()) * up).sum().backward();
  return {y.detach(), x.grad(), g.grad(), w.grad()};
}

}  // namespace

TEST_CASE("attention: gated RMSNorm's reference is the float64 formula", "[attention]") {
  auto f64 = torch::TensorOptions().dtype(torch::kFloat64);
  auto x = torch::randn({3, 5, 2, 16}, f64), g = torch::randn({3, 5, 2, 16}, f64);
  auto w = torch::rand({16}, f64) + 0.5;
  CHECK(test::relative_error(gated_rms_norm_reference(x, g, w, 1e-6), exact(x, g, w, 1e-6)) <
        1e-12);
  // The default path on the CPU is the reference.
  CHECK(torch::equal(gated_rms_norm(x, g, w, 1e-6), gated_rms_norm_reference(x, g, w, 1e-6)));
  CHECK(test::contains(test::error_of([&] { gated_rms_norm(x, g.narrow(-1, 0, 8), w, 1e-6); }),
                       "do not match"));
  CHECK(test::contains(test::error_of([&] { gated_rms_norm_kernel(x, g, w, 1e-6); }),
                       "gated RMSNorm kernel"));
}

TEST_CASE("attention: the gated RMSNorm kernels equal the float64 formula, values and gradients",
          "[attention][gpu]") {
  if (!torch::cuda::is_available()) {
    WARN("no CUDA device: skipped");
    return;
  }
  const auto cuda = torch::TensorOptions().device(torch::kCUDA);
  // Every supported head size; few vectors (one CTA) and many (grid-stride loops, 1,024 CTAs in
  // the weight-gradient reduction).
  for (int64_t dim : {32, 64, 128, 256}) {
    for (int64_t rows : {3, 8192}) {
      for (auto dtype : {torch::kBFloat16, torch::kFloat16, torch::kFloat32}) {
        INFO("dim " << dim << ", rows " << rows << ", dtype " << dtype);
        torch::manual_seed(dim + rows);
        auto x = (torch::randn({rows, 4, dim}, cuda) * 3).to(dtype);
        auto g = (torch::randn({rows, 4, dim}, cuda) * 2).to(dtype);
        auto w = torch::rand({dim}, cuda) + 0.5;
        auto up = torch::randn({rows, 4, dim}, cuda).to(dtype);
        auto ours = run(x, g, w, up, true);
        auto want = run(f64cpu(x), f64cpu(g), f64cpu(w), f64cpu(up), false);
        CHECK(ours.y.scalar_type() == dtype);
        const double tol = dtype == torch::kFloat32 ? 1e-5 : 8e-3;
        CHECK(test::relative_error(f64cpu(ours.y), want.y) < tol);
        CHECK(test::relative_error(f64cpu(ours.dx), want.dx) < tol);
        CHECK(test::relative_error(f64cpu(ours.dg), want.dg) < tol);
        CHECK(ours.dw.scalar_type() == torch::kFloat32);
        CHECK(test::relative_error(f64cpu(ours.dw), want.dw) < 1e-4);
      }
    }
  }
  // Shapes the kernel does not take are refused with the reason.
  auto x = torch::randn({4, 2, 48}, cuda);
  CHECK(test::contains(
      test::error_of([&] { gated_rms_norm_kernel(x, x, torch::ones({48}, cuda), 1e-6); }),
      "32, 64, 128 or 256"));
}
