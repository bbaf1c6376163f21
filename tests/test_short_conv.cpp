// The gated delta layers' input stage (causal depthwise conv of width 4, SiLU, L2-normalized q and
// k): the ATen reference against a float64 loop on the CPU, both reading directions, and the CUDA
// kernel (kernels/short_conv) against the reference, values and the gradients of the projection
// and the conv weight.
#include "attention/short_conv.h"
#include "catch_compat.h"
#include "test_helpers.h"

using namespace mhla;

namespace {

torch::Tensor f64cpu(const torch::Tensor& t) { return t.to(torch::kCPU, torch::kFloat64); }

// The formula token by token: p[t, c] = sum_j w[c, j] x[t - W + 1 + j, c] over the sequence as
// read (back to front when reversed), silu, then q and k divided by max(|.|, 1e-6) per head.
std::array<torch::Tensor, 3> loop_formula(const torch::Tensor& qkv, const torch::Tensor& weight,
                                          int64_t heads, bool reversed) {
  const auto b = qkv.size(0), n = qkv.size(1), channels = qkv.size(2), width = weight.size(2);
  auto x = reversed ? qkv.flip({1}) : qkv;
  auto w = weight.squeeze(1);  // [C, W]
  std::vector<torch::Tensor> rows;
  for (int64_t t = 0; t < n; ++t) {
    auto p = torch::zeros({b, channels}, qkv.options());
    for (int64_t j = 0; j < width; ++j) {
      const int64_t source = t - width + 1 + j;
      if (source >= 0) p = p + x.select(1, source) * w.select(1, j);
    }
    rows.push_back(torch::silu(p));
  }
  auto s = torch::stack(rows, 1).view({b, n, 3, heads, channels / 3 / heads});
  auto unit = [](const torch::Tensor& u) {
    return u / u.norm(2, -1, /*keepdim=*/true).clamp_min(1e-6);
  };
  return {unit(s.select(2, 0)), unit(s.select(2, 1)), s.select(2, 2)};
}

struct Grads {
  std::array<torch::Tensor, 3> out;
  torch::Tensor dx, dw;
};

Grads run(const torch::Tensor& x0, const torch::Tensor& w0, const std::array<torch::Tensor, 3>& up,
          int64_t heads, bool reversed, bool kernel) {
  auto x = x0.detach().clone().requires_grad_(true);
  auto w = w0.detach().clone().requires_grad_(true);
  auto out = kernel ? short_conv_qkv_kernel(x, w, heads, reversed)
                    : short_conv_qkv_reference(x, w, heads, reversed);
  auto loss = torch::zeros({}, up[0].options());
  for (int i = 0; i < 3; ++i) loss = loss + (out[i].to(up[i].scalar_type()) * up[i]).sum();
  loss.backward();
  return {{out[0].detach(), out[1].detach(), out[2].detach()}, x.grad(), w.grad()};
}

}  // namespace

TEST_CASE("attention: the short conv's reference is the token-by-token formula", "[attention]") {
  auto f64 = torch::TensorOptions().dtype(torch::kFloat64);
  torch::manual_seed(3);
  const int64_t heads = 2, d = 8;
  auto x = torch::randn({2, 7, 3 * heads * d}, f64);
  auto w = torch::randn({3 * heads * d, 1, 4}, f64);
  for (bool reversed : {false, true}) {
    INFO("reversed " << reversed);
    auto ours = short_conv_qkv_reference(x, w, heads, reversed);
    auto want = loop_formula(x, w, heads, reversed);
    for (int i = 0; i < 3; ++i) {
      CHECK(ours[i].sizes() == torch::IntArrayRef({2, 7, heads, d}));
      CHECK(test::relative_error(ours[i], want[i]) < 1e-12);
    }
    // The default path on the CPU is the reference.
    auto fused = short_conv_qkv(x, w, heads, reversed);
    for (int i = 0; i < 3; ++i) CHECK(torch::equal(fused[i], ours[i]));
  }
  // Reading back to front is the forward reading of the flipped sequence.
  auto flipped = short_conv_qkv_reference(x.flip({1}), w, heads, false);
  auto reversed = short_conv_qkv_reference(x, w, heads, true);
  for (int i = 0; i < 3; ++i) CHECK(torch::equal(flipped[i], reversed[i]));
  CHECK(test::contains(test::error_of([&] { short_conv_qkv(x, w, 5, false); }), "do not match"));
  CHECK(test::contains(test::error_of([&] { short_conv_qkv(x, w.narrow(0, 0, 8), 2, false); }),
                       "do not match"));
  CHECK(test::contains(test::error_of([&] { short_conv_qkv_kernel(x, w, heads, false); }),
                       "short conv kernel"));
}

TEST_CASE("attention: the short conv kernels equal the reference, values and gradients",
          "[attention][gpu]") {
  if (!torch::cuda::is_available()) {
    WARN("no CUDA device: skipped");
    return;
  }
  const auto cuda = torch::TensorOptions().device(torch::kCUDA);
  struct Shape {
    int64_t batch, tokens, heads, head_dim;
  };
  // Every head size; sequences shorter than the conv, not a multiple of the 64-token run, one
  // token; many runs per warp (40 x 1,000 tokens: 640 runs, over the backward's 128 x 4 warps per
  // column).
  const std::vector<Shape> shapes = {{2, 100, 2, 32}, {3, 3, 3, 64},     {1, 1, 1, 64},
                                     {2, 130, 2, 128}, {40, 1000, 1, 64}, {4, 256, 6, 64}};
  for (const auto& s : shapes) {
    for (bool reversed : {false, true}) {
      for (auto dtype : {torch::kFloat32, torch::kBFloat16, torch::kFloat16}) {
        INFO("B " << s.batch << " T " << s.tokens << " H " << s.heads << " D " << s.head_dim
                  << ", reversed " << reversed << ", dtype " << dtype);
        torch::manual_seed(s.tokens + s.head_dim + reversed);
        const int64_t channels = 3 * s.heads * s.head_dim;
        auto x = (torch::randn({s.batch, s.tokens, channels}, cuda) * 2).to(dtype);
        auto w = torch::randn({channels, 1, 4}, cuda) * 0.5;
        std::array<torch::Tensor, 3> up;
        for (auto& u : up) u = torch::randn({s.batch, s.tokens, s.heads, s.head_dim}, cuda);
        std::array<torch::Tensor, 3> up64 = {f64cpu(up[0]), f64cpu(up[1]), f64cpu(up[2])};
        auto ours = run(x, w, up, s.heads, reversed, true);
        auto want = run(f64cpu(x), f64cpu(w), up64, s.heads, reversed, false);
        // bf16 keeps 8 bits of mantissa, fp16 11: the same bound covers both.
        const double tol = dtype == torch::kFloat32 ? 1e-5 : 8e-3;
        for (int i = 0; i < 3; ++i) {
          CHECK(ours.out[i].scalar_type() == dtype);
          CHECK(ours.out[i].is_contiguous());
          CHECK(test::relative_error(f64cpu(ours.out[i]), want.out[i]) < tol);
        }
        CHECK(test::relative_error(f64cpu(ours.dx), want.dx) < tol);
        CHECK(ours.dw.scalar_type() == torch::kFloat32);
        CHECK(test::relative_error(f64cpu(ours.dw), want.dw) < (dtype == torch::kFloat32 ? 1e-5 : 5e-3));
      }
    }
  }
}

TEST_CASE("attention: the short conv kernel's gradients where a q or k norm is clamped",
          "[attention][gpu]") {
  if (!torch::cuda::is_available()) {
    WARN("no CUDA device: skipped");
    return;
  }
  const auto cuda = torch::TensorOptions().device(torch::kCUDA);
  torch::manual_seed(11);
  // Tokens 2..5 of the q and k parts scaled by 1e-9: token 5's whole conv window is tiny, so its
  // q and k norms (about 1e-9) are clamped to eps; tokens 2..4 still see unscaled tokens.
  auto x = torch::randn({2, 9, 3 * 2 * 32}, cuda);
  x.narrow(1, 2, 4).narrow(2, 0, 2 * 2 * 32).mul_(1e-9);
  auto w = torch::randn({3 * 2 * 32, 1, 4}, cuda) * 0.5;
  std::array<torch::Tensor, 3> up;
  for (auto& u : up) u = torch::randn({2, 9, 2, 32}, cuda);
  std::array<torch::Tensor, 3> up64 = {f64cpu(up[0]), f64cpu(up[1]), f64cpu(up[2])};
  auto ours = run(x, w, up, 2, false, true);
  auto want = run(f64cpu(x), f64cpu(w), up64, 2, false, false);
  for (int i = 0; i < 3; ++i) CHECK(test::relative_error(f64cpu(ours.out[i]), want.out[i]) < 1e-5);
  CHECK(test::relative_error(f64cpu(ours.dx), want.dx) < 1e-5);
  CHECK(test::relative_error(f64cpu(ours.dw), want.dw) < 1e-5);
}
