// The loss of the language models: the per-row cross-entropy with label smoothing, on the CPU
// (torch) and through kernels/cross_entropy on CUDA, against the float64 formula
//   loss = logsumexp(x) - (1 - eps) x_target - eps mean(x),
//   dloss/dx_j = softmax(x)_j - (1 - eps) [j == target] - eps / classes.
#include <cmath>
#include <limits>

#include "catch_compat.h"
#include "test_helpers.h"
#include "train/cross_entropy.h"

using namespace mhla;

namespace {

torch::Tensor f64cpu(const torch::Tensor& t) {
  return t.to(torch::kCPU, torch::kFloat64);
}

torch::Tensor exact_rows(const torch::Tensor& logits, const torch::Tensor& targets, double eps) {
  auto x = f64cpu(logits);
  auto t = targets.to(torch::kCPU).reshape({-1, 1});
  return x.logsumexp(1) - (1 - eps) * x.gather(1, t).squeeze(1) - eps * x.mean(1);
}

torch::Tensor exact_gradient(const torch::Tensor& logits, const torch::Tensor& targets, double eps,
                             const torch::Tensor& row_weights) {
  auto x = f64cpu(logits);
  auto onehot = torch::zeros_like(x).scatter_(1, targets.to(torch::kCPU).reshape({-1, 1}), 1.0);
  auto d = x.softmax(1) - (1 - eps) * onehot - eps / static_cast<double>(x.size(1));
  return d * f64cpu(row_weights).unsqueeze(1);
}

}  // namespace

TEST_CASE("train: cross-entropy on the CPU is the float64 formula, values and gradients",
          "[train]") {
  torch::manual_seed(3);
  auto f64 = torch::TensorOptions().dtype(torch::kFloat64);
  for (double eps : {0.0, 0.1}) {
    auto x = (torch::randn({6, 5, 11}, f64) * 3).requires_grad_(true);
    auto t = torch::randint(0, 11, {6, 5}, torch::kLong);
    auto loss = mean_cross_entropy(x, t, eps);
    auto rows = exact_rows(x.detach().reshape({-1, 11}), t.reshape({-1}), eps);
    CHECK(loss.scalar_type() == torch::kFloat64);
    CHECK(std::abs(loss.item<double>() - rows.mean().item<double>()) < 1e-12);
    CHECK(std::abs(summed_cross_entropy(x.detach(), t, eps).item<double>() -
                   rows.sum().item<double>()) < 1e-10);
    loss.backward();
    auto weights = torch::full({30}, 1.0 / 30, f64);
    CHECK(test::relative_error(
              x.grad().reshape({-1, 11}),
              exact_gradient(x.detach().reshape({-1, 11}), t.reshape({-1}), eps, weights)) < 1e-12);
  }
  // Float32 and bf16 logits are averaged in fp32.
  auto xb = torch::randn({4, 7}).to(torch::kBFloat16);
  auto tb = torch::randint(0, 7, {4}, torch::kLong);
  auto lb = mean_cross_entropy(xb, tb);
  CHECK(lb.scalar_type() == torch::kFloat32);
  CHECK(std::abs(lb.item<double>() - exact_rows(xb, tb, 0.0).mean().item<double>()) < 1e-5);
  // Shapes that do not pair up, and the kernel asked for where it cannot run.
  auto x = torch::randn({4, 7});
  CHECK(test::contains(
      test::error_of([&] { mean_cross_entropy(x, torch::zeros({5}, torch::kLong)); }),
      "5 targets for logits [4, 7]"));
  CHECK(test::contains(
      test::error_of([&] { cross_entropy_rows_kernel(x, torch::zeros({4}, torch::kLong), 0.0); }),
      "cross-entropy kernel"));
  CHECK(test::contains(
      test::error_of([&] { cross_entropy_rows_kernel(x, torch::zeros({4}, torch::kLong), 1.5); }),
      "label smoothing 1.5"));
}

TEST_CASE("train: the cross-entropy kernels equal the float64 formula, values and gradients",
          "[train][gpu]") {
  if (!torch::cuda::is_available()) {
    WARN("no CUDA device: skipped");
    return;
  }
  const auto cuda = torch::Device(torch::kCUDA);
  SECTION("shapes, dtypes and label smoothing") {
    // One class; DeiT's 10; an odd count (the scalar path); the GPT vocabulary (the 16-byte path)
    // on few and on many rows; GPT-2's odd 50,257.
    const std::vector<std::pair<int64_t, int64_t>> shapes = {{3, 1},     {257, 10},    {33, 1001},
                                                             {16, 8192}, {4096, 8192}, {5, 50257}};
    for (auto dtype : {torch::kBFloat16, torch::kFloat16, torch::kFloat32}) {
      for (auto [rows, classes] : shapes) {
        for (double eps : {0.0, 0.1}) {
          INFO("dtype " << dtype << ", rows " << rows << ", classes " << classes << ", eps "
                        << eps);
          torch::manual_seed(rows + classes);
          auto x = (torch::randn({rows, classes}, torch::TensorOptions().device(cuda)) * 4)
                       .to(dtype)
                       .requires_grad_(true);
          auto t = torch::randint(0, classes, {rows},
                                  torch::TensorOptions().device(cuda).dtype(torch::kLong));
          auto weights = torch::rand({rows}, torch::TensorOptions().device(cuda));
          auto loss_rows = cross_entropy_rows_kernel(x, t, eps);
          CHECK(loss_rows.scalar_type() == torch::kFloat32);
          (loss_rows * weights).sum().backward();
          CHECK(x.grad().scalar_type() == dtype);
          if (classes == 1) {
            // One class: the loss and its gradient are exactly 0 (relative errors are undefined).
            CHECK(loss_rows.abs().max().item<double>() < 1e-5);
            CHECK(x.grad().abs().max().item<double>() < 1e-5);
            continue;
          }
          CHECK(test::relative_error(f64cpu(loss_rows), exact_rows(x.detach(), t, eps)) < 1e-5);
          const double tolerance = dtype == torch::kFloat32 ? 1e-5 : 1e-2;
          CHECK(test::relative_error(f64cpu(x.grad()),
                                     exact_gradient(x.detach(), t, eps, weights)) < tolerance);
        }
      }
    }
  }
  SECTION("rows that are a strided view, masked logits, a target out of range") {
    auto wide = torch::randn({64, 8200}, torch::TensorOptions().device(cuda)).to(torch::kBFloat16);
    auto x = wide.narrow(1, 0, 8192);  // row stride 8,200: 16-byte aligned rows, vector path
    auto t = torch::randint(0, 8192, {64}, torch::TensorOptions().device(cuda).dtype(torch::kLong));
    CHECK(test::relative_error(f64cpu(cross_entropy_rows_kernel(x, t, 0.1)),
                               exact_rows(x, t, 0.1)) < 1e-5);
    auto odd = wide.narrow(1, 1, 8191);  // misaligned rows: scalar path
    auto t2 =
        torch::randint(0, 8191, {64}, torch::TensorOptions().device(cuda).dtype(torch::kLong));
    CHECK(test::relative_error(f64cpu(cross_entropy_rows_kernel(odd, t2, 0.0)),
                               exact_rows(odd, t2, 0.0)) < 1e-5);
    // -inf logits (masked classes) add nothing and get a zero gradient.
    auto masked = torch::randn({8, 64}, torch::TensorOptions().device(cuda));
    masked.narrow(1, 32, 32).fill_(-std::numeric_limits<float>::infinity());
    masked.requires_grad_(true);
    auto t3 = torch::randint(0, 32, {8}, torch::TensorOptions().device(cuda).dtype(torch::kLong));
    auto rows = cross_entropy_rows_kernel(masked, t3, 0.0);
    auto exact = exact_rows(masked.detach().narrow(1, 0, 32), t3, 0.0);
    CHECK(test::relative_error(f64cpu(rows), exact) < 1e-5);
    rows.sum().backward();
    CHECK(masked.grad().narrow(1, 32, 32).abs().max().item<float>() == 0.0f);
    // A target outside [0, classes) makes its row NaN instead of reading out of bounds.
    auto bad = torch::tensor({0, 70, -1}, torch::TensorOptions().device(cuda).dtype(torch::kLong));
    auto r = cross_entropy_rows_kernel(torch::randn({3, 70}, torch::TensorOptions().device(cuda)),
                                       bad, 0.0)
                 .cpu();
    CHECK(std::isfinite(r[0].item<float>()));
    CHECK(std::isnan(r[1].item<float>()));
    CHECK(std::isnan(r[2].item<float>()));
  }
  SECTION("the training loss takes the kernel and equals torch's cross-entropy") {
    auto x = torch::randn({2, 128, 8192}, torch::TensorOptions().device(cuda)).to(torch::kBFloat16);
    auto t =
        torch::randint(0, 8192, {2, 128}, torch::TensorOptions().device(cuda).dtype(torch::kLong));
    CHECK(cross_entropy_uses_kernel(x));
    auto ours = mean_cross_entropy(x, t, 0.1).item<double>();
    namespace F = torch::nn::functional;
    auto theirs = F::cross_entropy(x.reshape({-1, 8192}).to(torch::kFloat32), t.reshape({-1}),
                                   F::CrossEntropyFuncOptions().label_smoothing(0.1))
                      .item<double>();
    CHECK(std::abs(ours - theirs) < 1e-5 * std::abs(theirs));
  }
}
