// The CPE's depthwise conv over the patch grid of block-major tokens: the ATen reference against a
// float64 loop over grid positions on the CPU, and the CUDA kernels (kernels/grid_conv) against
// the reference, values and the gradients of x, the weight and the bias, over the layouts the
// models build (MHLA's 4 x 4 tiles, the 1 x 1 tiling of the other types, tiles that are not
// square, grids cut into several bands of rows, one of them shorter, grids too wide for the small
// shared-memory budget) and strided inputs.
#include "attention/grid_depthwise_conv.h"
#include "catch_compat.h"
#include "test_helpers.h"

using namespace mhla;

namespace {

torch::Tensor f64cpu(const torch::Tensor& t) {
  return t.defined() ? t.to(torch::kCPU, torch::kFloat64) : t;
}

// Block-major token of grid position (y, x).
int64_t token_of(const TokenLayout& l, int64_t y, int64_t x) {
  const int64_t th = l.tile_h(), tw = l.tile_w();
  return ((y / th) * l.tiles_w + x / tw) * th * tw + (y % th) * tw + x % tw;
}

// out[b, token(y, x), c] = bias[c] + sum_{i, j} w[c, 0, i, j] x[b, token(y + i - r, x + j - r), c]
// over positions inside the grid, written position by position.
torch::Tensor loop_formula(const torch::Tensor& x, const torch::Tensor& w,
                           const torch::Tensor& bias, const TokenLayout& l) {
  const int64_t k = w.size(2), r = k / 2;
  auto out = torch::zeros_like(x);
  for (int64_t y = 0; y < l.grid_h; ++y) {
    for (int64_t xx = 0; xx < l.grid_w; ++xx) {
      auto acc = bias.defined() ? bias.unsqueeze(0).expand({x.size(0), x.size(2)}).clone()
                                : torch::zeros({x.size(0), x.size(2)}, x.options());
      for (int64_t i = 0; i < k; ++i) {
        for (int64_t j = 0; j < k; ++j) {
          const int64_t sy = y + i - r, sx = xx + j - r;
          if (sy < 0 || sy >= l.grid_h || sx < 0 || sx >= l.grid_w) continue;
          acc = acc + x.select(1, token_of(l, sy, sx)) * w.select(2, i).select(2, j).view({-1});
        }
      }
      out.select(1, token_of(l, y, xx)).copy_(acc);
    }
  }
  return out;
}

struct Grads {
  torch::Tensor out, dx, dw, db;
};

// Forward and backward against the upstream gradient `up`; x is first placed as the third part
// of a [B, N, 3, C] tensor when strided (v of a fused projection).
Grads run(const torch::Tensor& x0, const torch::Tensor& w0, const torch::Tensor& b0,
          const torch::Tensor& up, const TokenLayout& l, bool kernel, bool strided) {
  auto leaf = strided ? torch::stack({torch::zeros_like(x0), torch::zeros_like(x0), x0}, 2)
                            .detach()
                            .requires_grad_(true)
                      : x0.detach().clone().requires_grad_(true);
  auto x = strided ? leaf.select(2, 2) : leaf;
  auto w = w0.detach().clone().requires_grad_(true);
  auto b = b0.defined() ? b0.detach().clone().requires_grad_(true) : b0;
  auto out =
      kernel ? grid_depthwise_conv_kernel(x, w, b, l) : grid_depthwise_conv_reference(x, w, b, l);
  (out.to(up.scalar_type()) * up).sum().backward();
  auto dx = strided ? leaf.grad().select(2, 2) : leaf.grad();
  return {out.detach(), dx, w.grad(), b.defined() ? b.grad() : torch::Tensor()};
}

}  // namespace

TEST_CASE("attention: the grid conv's reference is the position-by-position formula",
          "[attention]") {
  auto f64 = torch::TensorOptions().dtype(torch::kFloat64);
  torch::manual_seed(5);
  // A 6 x 8 grid in 2 x 2 tiles of 3 x 4 (block-major order differs from raster order), and the
  // 1 x 1 tiling (raster order).
  for (const TokenLayout l : {TokenLayout{6, 8, 2, 2}, TokenLayout{6, 8, 1, 1}}) {
    for (int64_t k : {3, 5}) {
      INFO("tiles " << l.tiles_h << " x " << l.tiles_w << ", kernel " << k);
      auto x = torch::randn({2, 48, 5}, f64);
      auto w = torch::randn({5, 1, k, k}, f64);
      auto bias = torch::randn({5}, f64);
      auto ours = grid_depthwise_conv_reference(x, w, bias, l);
      CHECK(ours.sizes() == x.sizes());
      CHECK(test::relative_error(ours, loop_formula(x, w, bias, l)) < 1e-12);
      auto unbiased = grid_depthwise_conv_reference(x, w, torch::Tensor(), l);
      CHECK(test::relative_error(unbiased, loop_formula(x, w, torch::Tensor(), l)) < 1e-12);
      // The default path on the CPU is the reference.
      CHECK(torch::equal(grid_depthwise_conv(x, w, bias, l), ours));
      auto base = torch::randn({2, 48, 5}, f64);
      CHECK(torch::equal(grid_depthwise_conv_added(base, x, w, bias, l), base + ours));
    }
  }
  const TokenLayout l{6, 8, 2, 2};
  auto x = torch::randn({2, 48, 5}, f64);
  auto w = torch::randn({5, 1, 3, 3}, f64);
  CHECK(test::contains(test::error_of([&] { grid_depthwise_conv(x.narrow(1, 0, 40), w, {}, l); }),
                       "do not match"));
  CHECK(test::contains(test::error_of([&] {
                         grid_depthwise_conv(x, torch::randn({5, 1, 2, 2}, f64), {}, l);
                       }),
                       "k odd"));
  CHECK(
      test::contains(test::error_of([&] { grid_depthwise_conv(x, w, torch::randn({4}, f64), l); }),
                     "do not match"));
  CHECK(test::contains(test::error_of([&] { grid_depthwise_conv_kernel(x, w, {}, l); }),
                       "grid depthwise conv kernel"));
}

TEST_CASE("attention: the grid conv kernels equal the reference, values and gradients",
          "[attention][gpu]") {
  if (!torch::cuda::is_available()) {
    WARN("no CUDA device: skipped");
    return;
  }
  const auto cuda = torch::TensorOptions().device(torch::kCUDA);
  struct Case {
    int64_t batch, channels;
    TokenLayout layout;
  };
  // DeiT-T/2 with MHLA (16 x 16 grid, 4 x 4 tiles, C = 192: three 128-byte channel chunks in
  // 16 bits; the backward in two bands of 8 rows) and the other types' 1 x 1 tiling; DiT-S's
  // width (C = 384); tiles of 3 x 5 in a 6 x 10 grid; 9 x 9 in 3 x 3 tiles; C = 40 (a chunk
  // narrower than 128 bytes); a grid one token wide; 24 x 24 (backward bands of 5, 5, 5, 5 and 4
  // rows); a grid 130 wide (three rows do not fit the small budget: the large one, 6 rows in two
  // bands in the backward, one band of 6 rows over 48 KB in the forward).
  const std::vector<Case> cases = {{3, 192, {16, 16, 4, 4}}, {2, 192, {16, 16, 1, 1}},
                                   {2, 384, {8, 8, 2, 2}},   {2, 64, {6, 10, 2, 2}},
                                   {3, 40, {9, 9, 3, 3}},    {2, 16, {5, 1, 1, 1}},
                                   {2, 64, {24, 24, 4, 4}},  {1, 32, {6, 130, 2, 2}}};
  for (const auto& c : cases) {
    for (auto dtype : {torch::kFloat32, torch::kBFloat16, torch::kFloat16}) {
      for (bool strided : {false, true}) {
        for (bool with_bias : {true, false}) {
          const auto& l = c.layout;
          INFO("B " << c.batch << " C " << c.channels << " grid " << l.grid_h << " x " << l.grid_w
                    << " tiles " << l.tiles_h << " x " << l.tiles_w << ", dtype " << dtype
                    << ", strided " << strided << ", bias " << with_bias);
          torch::manual_seed(c.channels + l.tokens() + strided);
          auto x = torch::randn({c.batch, l.tokens(), c.channels}, cuda).to(dtype);
          auto w = torch::randn({c.channels, 1, 3, 3}, cuda) * 0.5;
          auto bias = with_bias ? torch::randn({c.channels}, cuda) : torch::Tensor();
          auto up = torch::randn({c.batch, l.tokens(), c.channels}, cuda);
          auto ours = run(x, w, bias, up, l, true, strided);
          auto want = run(f64cpu(x), f64cpu(w), f64cpu(bias), f64cpu(up), l, false, false);
          // The kernel keeps x's dtype and sums in fp32: one rounding of the output.
          const double tol = dtype == torch::kFloat32 ? 1e-5 : 8e-3;
          CHECK(ours.out.scalar_type() == dtype);
          CHECK(test::relative_error(f64cpu(ours.out), want.out) < tol);
          CHECK(test::relative_error(f64cpu(ours.dx), want.dx) < tol);
          CHECK(ours.dw.scalar_type() == torch::kFloat32);
          // dw sums B * N products of x with the upstream gradient rounded to dtype.
          CHECK(test::relative_error(f64cpu(ours.dw), want.dw) <
                (dtype == torch::kFloat32 ? 1e-5 : 5e-3));
          if (with_bias) {
            CHECK(test::relative_error(f64cpu(ours.db), want.db) <
                  (dtype == torch::kFloat32 ? 1e-5 : 5e-3));
          } else {
            CHECK(!ours.db.defined());
          }
        }
      }
    }
  }
}

TEST_CASE("attention: the grid conv kernel adds a base in its pass, values and gradients",
          "[attention][gpu]") {
  if (!torch::cuda::is_available()) {
    WARN("no CUDA device: skipped");
    return;
  }
  const auto cuda = torch::TensorOptions().device(torch::kCUDA);
  const TokenLayout l{16, 16, 4, 4};
  for (auto dtype : {torch::kFloat32, torch::kBFloat16}) {
    INFO("dtype " << dtype);
    torch::manual_seed(11);
    auto x0 = torch::randn({3, l.tokens(), 192}, cuda).to(dtype);
    auto base0 = torch::randn({3, l.tokens(), 192}, cuda).to(dtype);
    auto w0 = torch::randn({192, 1, 3, 3}, cuda) * 0.5;
    auto b0 = torch::randn({192}, cuda);
    auto up = torch::randn({3, l.tokens(), 192}, cuda);
    auto x = x0.clone().requires_grad_(true), base = base0.clone().requires_grad_(true);
    auto w = w0.clone().requires_grad_(true), b = b0.clone().requires_grad_(true);
    auto out = grid_depthwise_conv_added(base, x, w, b, l);
    CHECK(out.scalar_type() == dtype);
    CHECK(out.grad_fn()->name().find("GridConvFunction") != std::string::npos);  // one pass
    (out.to(torch::kFloat32) * up).sum().backward();
    auto want = run(f64cpu(x0), f64cpu(w0), f64cpu(b0), f64cpu(up), l, false, false);
    const double tol = dtype == torch::kFloat32 ? 1e-5 : 8e-3;
    CHECK(test::relative_error(f64cpu(out), f64cpu(base0) + want.out) < tol);
    // The base's gradient is the upstream gradient as the output's dtype carries it.
    CHECK(torch::equal(base.grad(), up.to(dtype)));
    CHECK(test::relative_error(f64cpu(x.grad()), want.dx) < tol);
    CHECK(test::relative_error(f64cpu(w.grad()), want.dw) <
          (dtype == torch::kFloat32 ? 1e-5 : 5e-3));
    CHECK(test::relative_error(f64cpu(b.grad()), want.db) <
          (dtype == torch::kFloat32 ? 1e-5 : 5e-3));
  }
  // A base the kernel does not write (another dtype) is added outside it, in the base's dtype.
  auto x = torch::randn({2, l.tokens(), 64}, cuda).to(torch::kBFloat16);
  auto base = torch::randn({2, l.tokens(), 64}, cuda);
  auto w = torch::randn({64, 1, 3, 3}, cuda);
  auto mixed = grid_depthwise_conv_added(base, x, w, {}, l);
  CHECK(mixed.scalar_type() == torch::kFloat32);
  CHECK(torch::equal(mixed, base + grid_depthwise_conv(x, w, {}, l).to(torch::kFloat32)));
}

TEST_CASE("attention: the grid conv kernel's weight gradients are the same bits on every run",
          "[attention][gpu]") {
  if (!torch::cuda::is_available()) {
    WARN("no CUDA device: skipped");
    return;
  }
  const auto cuda = torch::TensorOptions().device(torch::kCUDA);
  torch::manual_seed(9);
  const TokenLayout l{16, 16, 4, 4};
  auto x = torch::randn({64, l.tokens(), 192}, cuda).to(torch::kBFloat16);
  auto w = torch::randn({192, 1, 3, 3}, cuda);
  auto bias = torch::randn({192}, cuda);
  auto up = torch::randn({64, l.tokens(), 192}, cuda);
  auto first = run(x, w, bias, up, l, true, true);
  for (int i = 0; i < 3; ++i) {
    auto again = run(x, w, bias, up, l, true, true);
    CHECK(torch::equal(again.out, first.out));
    CHECK(torch::equal(again.dx, first.dx));
    CHECK(torch::equal(again.dw, first.dw));
    CHECK(torch::equal(again.db, first.db));
  }
  // Kernel sizes the kernels do not take run the reference on the GPU too.
  auto w5 = torch::randn({192, 1, 5, 5}, cuda);
  auto fused = grid_depthwise_conv(x, w5, bias, l);
  auto reference = grid_depthwise_conv_reference(x, w5, bias, l);
  CHECK(torch::equal(fused, reference));
  // So do grids too wide for two three-row tiles in shared memory (the kernel itself refuses).
  const TokenLayout wide{1, 400, 1, 1};
  auto xw = torch::randn({2, wide.tokens(), 32}, cuda).to(torch::kBFloat16);
  auto ww = torch::randn({32, 1, 3, 3}, cuda);
  CHECK(torch::equal(grid_depthwise_conv(xw, ww, {}, wide),
                     grid_depthwise_conv_reference(xw, ww, {}, wide)));
  CHECK(test::contains(test::error_of([&] { grid_depthwise_conv_kernel(xw, ww, {}, wide); }),
                       "grid depthwise conv kernel"));
}
