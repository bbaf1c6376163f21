// Every attention type against a dense O(N^2) formula in float64: outputs and gradients of q, k,
// v (and the MHLA mixing matrix) to 1e-10; MHLA with one block equals linear attention.
#include <cmath>

#include "attention/attention_type.h"
#include "attention/causal_linear.h"
#include "attention/linear.h"
#include "attention/mhla.h"
#include "attention/softmax.h"
#include "attention/token_layout.h"
#include "catch_compat.h"
#include "core/error.h"
#include "test_helpers.h"

using namespace mhla;

namespace {

auto f64() { return torch::TensorOptions().dtype(torch::kFloat64); }

// Dense formulas, written independently of the references: A[i, j] built explicitly.
torch::Tensor dense_softmax(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
  auto scores = torch::einsum("bihd,bjhd->bhij", {q, k}) / std::sqrt(static_cast<double>(q.size(3)));
  return torch::einsum("bhij,bjhe->bihe", {torch::softmax(scores, -1), v});
}

torch::Tensor phi(const torch::Tensor& x) {
  auto rms = torch::sqrt(x.pow(2).mean(-1, true) + 1e-6);
  return torch::relu(x / rms) + 1e-6;
}

torch::Tensor dense_weighted(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                             const torch::Tensor& token_weights /* [N, N] */) {
  auto a = torch::einsum("bihd,bjhd->bhij", {phi(q), phi(k)}) * token_weights;
  auto out = torch::einsum("bhij,bjhe->bihe", {a, v});
  auto norm = a.sum(-1).permute({0, 2, 1}).unsqueeze(-1) + 1e-6;  // [B, N, H, 1]
  return out / norm;
}

torch::Tensor dense_linear(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
  const auto n = q.size(1);
  return dense_weighted(q, k, v, torch::ones({n, n}, q.options()));
}

torch::Tensor dense_mhla(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                         const torch::Tensor& mixing) {
  const auto n = q.size(1), m = mixing.size(0), l = n / m;
  auto block = torch::div(torch::arange(n, torch::kLong), l, "floor");
  auto weights = mixing.index({block.unsqueeze(1), block.unsqueeze(0)});
  return dense_weighted(q, k, v, weights);
}

struct Grads {
  torch::Tensor out, dq, dk, dv, dmixing;
};

template <typename F>
Grads run_with_grads(F f, torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor mixing,
                     const torch::Tensor& upstream) {
  q = q.detach().clone().requires_grad_(true);
  k = k.detach().clone().requires_grad_(true);
  v = v.detach().clone().requires_grad_(true);
  if (mixing.defined()) mixing = mixing.detach().clone().requires_grad_(true);
  auto out = f(q, k, v, mixing);
  (out * upstream).sum().backward();
  return {out.detach(), q.grad(), k.grad(), v.grad(), mixing.defined() ? mixing.grad() : torch::Tensor()};
}

void check_close(const Grads& a, const Grads& b, double tolerance) {
  CHECK(test::relative_error(a.out, b.out) < tolerance);
  CHECK(test::relative_error(a.dq, b.dq) < tolerance);
  CHECK(test::relative_error(a.dk, b.dk) < tolerance);
  CHECK(test::relative_error(a.dv, b.dv) < tolerance);
  if (b.dmixing.defined()) CHECK(test::relative_error(a.dmixing, b.dmixing) < tolerance);
}

}  // namespace

TEST_CASE("attention: softmax reference equals the dense formula (float64)", "[attention]") {
  torch::manual_seed(1);
  for (bool causal : {false}) {
    auto q = torch::randn({2, 24, 3, 16}, f64()), k = torch::randn({2, 24, 3, 16}, f64());
    auto v = torch::randn({2, 24, 3, 16}, f64()), up = torch::randn({2, 24, 3, 16}, f64());
    OpArgs args;
    args.causal = causal;
    auto ours = run_with_grads([&](auto q_, auto k_, auto v_, auto) {
      return softmax_attention_reference(q_, k_, v_, args);
    }, q, k, v, {}, up);
    auto dense = run_with_grads([](auto q_, auto k_, auto v_, auto) { return dense_softmax(q_, k_, v_); },
                                q, k, v, {}, up);
    check_close(ours, dense, 1e-10);
  }
}

TEST_CASE("attention: linear reference equals the dense formula (float64)", "[attention]") {
  torch::manual_seed(2);
  auto q = torch::randn({2, 33, 2, 8}, f64()), k = torch::randn({2, 33, 2, 8}, f64());
  auto v = torch::randn({2, 33, 2, 12}, f64()), up = torch::randn({2, 33, 2, 12}, f64());
  auto ours = run_with_grads([](auto q_, auto k_, auto v_, auto) {
    return linear_attention_reference(q_, k_, v_, OpArgs{});
  }, q, k, v, {}, up);
  auto dense = run_with_grads([](auto q_, auto k_, auto v_, auto) { return dense_linear(q_, k_, v_); },
                              q, k, v, {}, up);
  check_close(ours, dense, 1e-10);
}

TEST_CASE("attention: MHLA reference equals the dense block-mixed formula (float64)", "[attention]") {
  torch::manual_seed(3);
  for (int64_t blocks : {1, 4, 9, 16}) {
    INFO("blocks = " << blocks);
    const int64_t n = blocks * 5;
    auto q = torch::randn({2, n, 3, 8}, f64()) * 3, k = torch::randn({2, n, 3, 8}, f64());
    auto v = torch::randn({2, n, 3, 8}, f64()), up = torch::randn({2, n, 3, 8}, f64());
    auto mixing = torch::rand({blocks, blocks}, f64());
    auto ours = run_with_grads([&](auto q_, auto k_, auto v_, auto m_) {
      OpArgs args;
      args.blocks = blocks;
      args.mixing = m_;
      return mhla_reference(q_, k_, v_, args);
    }, q, k, v, mixing, up);
    auto dense = run_with_grads([](auto q_, auto k_, auto v_, auto m_) { return dense_mhla(q_, k_, v_, m_); },
                                q, k, v, mixing, up);
    check_close(ours, dense, 1e-10);
  }
}

TEST_CASE("attention: MHLA gradients match central finite differences", "[attention]") {
  torch::manual_seed(4);
  const int64_t blocks = 4, n = 8;
  auto q = torch::randn({1, n, 1, 4}, f64()), k = torch::randn({1, n, 1, 4}, f64());
  auto v = torch::randn({1, n, 1, 4}, f64()), mixing = torch::rand({blocks, blocks}, f64());
  auto up = torch::randn({1, n, 1, 4}, f64());
  auto loss = [&](const torch::Tensor& q_, const torch::Tensor& k_, const torch::Tensor& v_,
                  const torch::Tensor& m_) {
    OpArgs args;
    args.blocks = blocks;
    args.mixing = m_;
    return (mhla_reference(q_, k_, v_, args) * up).sum();
  };
  auto g = run_with_grads([&](auto q_, auto k_, auto v_, auto m_) {
    OpArgs args;
    args.blocks = blocks;
    args.mixing = m_;
    return mhla_reference(q_, k_, v_, args);
  }, q, k, v, mixing, up);
  const double h = 1e-6;
  auto numeric = [&](torch::Tensor& target, int64_t index) {
    auto flat = target.view({-1});
    const double saved = flat[index].item<double>();
    flat[index] = saved + h;
    const double plus = loss(q, k, v, mixing).item<double>();
    flat[index] = saved - h;
    const double minus = loss(q, k, v, mixing).item<double>();
    flat[index] = saved;
    return (plus - minus) / (2 * h);
  };
  for (int64_t i = 0; i < q.numel(); i += 3) {
    CHECK(numeric(q, i) == Approx(g.dq.view({-1})[i].item<double>()).margin(1e-6));
    CHECK(numeric(k, i) == Approx(g.dk.view({-1})[i].item<double>()).margin(1e-6));
    CHECK(numeric(v, i) == Approx(g.dv.view({-1})[i].item<double>()).margin(1e-6));
  }
  for (int64_t i = 0; i < mixing.numel(); ++i) {
    CHECK(numeric(mixing, i) == Approx(g.dmixing.view({-1})[i].item<double>()).margin(1e-6));
  }
}

TEST_CASE("attention: MHLA with one block is linear attention", "[attention]") {
  torch::manual_seed(5);
  auto q = torch::randn({3, 20, 2, 16}, f64()), k = torch::randn({3, 20, 2, 16}, f64());
  auto v = torch::randn({3, 20, 2, 16}, f64());
  OpArgs args;
  args.blocks = 1;
  args.mixing = mhla_initial_mixing("locality", 1, 1).to(torch::kFloat64);
  CHECK(args.mixing.item<double>() == 1.0);
  CHECK(test::relative_error(mhla_reference(q, k, v, args), linear_attention_reference(q, k, v, {})) < 1e-12);
}

TEST_CASE("attention: references compute in float32 for low-precision inputs", "[attention]") {
  torch::manual_seed(6);
  auto q = torch::randn({2, 16, 2, 32}), k = torch::randn({2, 16, 2, 32}), v = torch::randn({2, 16, 2, 32});
  OpArgs args;
  args.blocks = 4;
  args.mixing = torch::rand({4, 4});
  auto exact = mhla_reference(q.to(torch::kFloat64), k.to(torch::kFloat64), v.to(torch::kFloat64),
                              OpArgs{false, 4, args.mixing.to(torch::kFloat64)});
  auto bf16 = mhla_reference(q.to(torch::kBFloat16), k.to(torch::kBFloat16), v.to(torch::kBFloat16), args);
  CHECK(bf16.scalar_type() == torch::kBFloat16);
  CHECK(test::relative_error(bf16, exact) < 2e-2);
  CHECK(test::relative_error(mhla_reference(q, k, v, args), exact) < 1e-5);
}

TEST_CASE("attention: locality init follows the paper", "[attention]") {
  auto m = mhla_initial_mixing("locality", 2, 2);
  // From tile 0: distances 0, 1, 1, sqrt(2) -> weights 1, 1 - 1/sqrt(2) (twice), 0, normalized.
  const double side = 1.0 - 1.0 / std::sqrt(2.0), total = 1.0 + 2 * side;
  CHECK(m[0][0].item<double>() == Approx(1.0 / total));
  CHECK(m[0][1].item<double>() == Approx(side / total));
  CHECK(m[0][3].item<double>() == Approx(0.0).margin(1e-7));
  auto big = mhla_initial_mixing("locality", 4, 4);
  CHECK(test::relative_error(big.sum(1), torch::ones({16})) < 1e-6);
  CHECK(big.min().item<double>() >= 0.0);
  CHECK((big.argmax(1) == torch::arange(16)).all().item<bool>());  // own tile weighs most
  auto uniform = mhla_initial_mixing("uniform", 3, 3);
  CHECK(test::relative_error(uniform, torch::full({9, 9}, 1.0 / 9)) < 1e-7);
  CHECK_THROWS_AS(mhla_initial_mixing("random", 2, 2), Error);
}

TEST_CASE("attention: token layout keeps tiles contiguous and round-trips", "[attention]") {
  TokenLayout layout{8, 8, 2, 2};
  auto grid = torch::arange(64, torch::kFloat32).view({1, 1, 8, 8});
  auto tokens = layout.to_tokens(grid);  // [1, 64, 1]
  // The first 16 tokens are the top-left 4x4 tile, row by row.
  auto first_tile = tokens.view({-1}).slice(0, 0, 16);
  auto expected = grid.view({8, 8}).slice(0, 0, 4).slice(1, 0, 4).reshape({-1});
  CHECK(torch::equal(first_tile, expected));
  CHECK(torch::equal(layout.to_grid(tokens), grid));
}

TEST_CASE("attention: layers build from the registry; MHLA mixing is projected to [0, 1]", "[attention][registry]") {
  for (const auto& name : attention_registry().names()) {
    INFO(name);
    const auto& type = attention_registry().get(name);
    AttentionSpec spec;
    spec.dim = 32;
    spec.heads = 4;
    spec.layout = TokenLayout{4, 4, type.uses_blocks ? 2 : 1, type.uses_blocks ? 2 : 1};
    spec.config.type = name;
    spec.config.blocks = 4;
    spec.config.cpe = true;
    spec.config.gate = true;
    auto layer = type.make_layer(spec, type);
    auto x = torch::randn({2, 16, 32}, torch::requires_grad());
    auto y = layer->forward(x);
    CHECK(y.sizes() == x.sizes());
    y.sum().backward();
    CHECK(x.grad().isfinite().all().item<bool>());
    for (const auto& p : layer->parameters()) CHECK(p.grad().defined());
  }
  const auto& type = attention_registry().get("mhla");
  AttentionSpec spec;
  spec.dim = 16;
  spec.heads = 2;
  spec.layout = TokenLayout{4, 4, 2, 2};
  spec.config.blocks = 4;
  auto layer = std::dynamic_pointer_cast<MhlaLayerImpl>(type.make_layer(spec, type));
  REQUIRE(layer);
  {
    torch::NoGradGuard no_grad;
    layer->mixing().copy_(torch::tensor({{-1.0, 0.5, 2.0, 0.1}, {0.0, 0.0, 0.0, 0.0}, {1.0, 1.0, 1.0, 1.0}, {3.0, -3.0, 0.5, 0.5}}));
  }
  layer->project_parameters();
  CHECK(layer->mixing().min().item<double>() == 0.0);
  CHECK(layer->mixing().max().item<double>() == 1.0);
  CHECK(layer->mixing()[0][1].item<double>() == 0.5);
}

TEST_CASE("attention: backends are checked by name and device", "[attention][registry]") {
  const auto& type = attention_registry().get("linear");
  std::string available;  // "cuda, reference" where the kernels are built, else "reference"
  for (const auto& [name, fn] : type.backends) available += (available.empty() ? "" : ", ") + name;
  CHECK_THROWS_WITH(select_backend("linear", type, "cudnn", torch::kCPU, "c.yaml:4"),
                    "c.yaml:4: attention type 'linear' has no backend 'cudnn' in this build; available: " + available);
  CHECK_NOTHROW(select_backend("linear", type, "auto", torch::kCPU, "x"));
  // auto on the CPU is the reference.
  CHECK(&select_backend("linear", type, "auto", torch::kCPU, "x", true) == &type.backends.at("reference"));
  if (type.backends.count("cuda")) {
    CHECK_THROWS_WITH(select_backend("linear", type, "cuda", torch::kCPU, "c.yaml:5"),
                      "c.yaml:5: backend 'cuda' of attention type 'linear' needs a CUDA device, the run is on cpu");
    // The kernels have both modes: auto on a GPU takes them for causal layers too.
    CHECK(&select_backend("linear", type, "auto", torch::kCUDA, "x", true) == &type.backends.at("cuda"));
    CHECK(&select_backend("linear", type, "auto", torch::kCUDA, "x", false) == &type.backends.at("cuda"));
    CHECK(&select_backend("mhla", attention_registry().get("mhla"), "auto", torch::kCUDA, "x", true) ==
          &attention_registry().get("mhla").backends.at("cuda"));
  }
  // A backend without a causal mode refuses causal layers by name, and auto skips it for them.
  AttentionType partial;
  const OpFn any = [](const torch::Tensor& q, const torch::Tensor&, const torch::Tensor&,
                      const OpArgs&) { return q; };
  partial.backends = {{"reference", any}, {"fast", any}};
  partial.gpu_preference = {"fast"};
  partial.causal_modes = {false, true};
  partial.bidirectional_only = {"fast"};
  CHECK_THROWS_WITH(select_backend("toy", partial, "fast", torch::kCUDA, "c.yaml:6", true),
                    "c.yaml:6: backend 'fast' of attention type 'toy' implements the bidirectional op only; "
                    "causal layers run on 'reference' (or say backend: auto)");
  CHECK(&select_backend("toy", partial, "auto", torch::kCUDA, "x", true) == &partial.backends.at("reference"));
  CHECK(&select_backend("toy", partial, "auto", torch::kCUDA, "x", false) == &partial.backends.at("fast"));
  CHECK_THROWS_WITH(attention_registry().get("flash"),
                    "unknown attention type 'flash'; registered: gated_deltanet, kda, linear, mhla, softmax");
}

TEST_CASE("attention: references on the GPU match float64 on the CPU", "[attention][gpu]") {
  if (!torch::cuda::is_available()) {
    WARN("no CUDA device: skipped");
    return;
  }
  torch::manual_seed(7);
  for (const auto& name : attention_registry().names()) {
    INFO(name);
    const auto& type = attention_registry().get(name);
    auto q = torch::randn({4, 64, 3, 32}), k = torch::randn({4, 64, 3, 32}), v = torch::randn({4, 64, 3, 32});
    OpArgs args = type.make_args({4, 64, 3, 32, 16, type.causal_modes.front()}, torch::TensorOptions());
    auto convert = [](OpArgs a, const torch::TensorOptions& o) {
      for (auto* t : {&a.mixing, &a.beta, &a.gate}) {
        if (t->defined()) *t = t->to(o);
      }
      return a;
    };
    OpArgs args64 = convert(args, torch::TensorOptions().dtype(torch::kFloat64));
    auto exact = type.backends.at("reference")(q.to(torch::kFloat64), k.to(torch::kFloat64),
                                              v.to(torch::kFloat64), args64);
    OpArgs cuda_args = convert(args, torch::TensorOptions().device(torch::kCUDA));
    auto gpu = type.backends.at("reference")(q.cuda(), k.cuda(), v.cuda(), cuda_args);
    CHECK(test::relative_error(gpu, exact) < 1e-4);
  }
}

TEST_CASE("attention: causal layers ignore the future, bidirectional ones see both sides", "[attention]") {
  torch::manual_seed(31);
  for (const auto& name : attention_registry().names()) {
    const auto& type = attention_registry().get(name);
    for (bool causal : type.causal_modes) {
      if (!causal) continue;
      INFO(name);
      AttentionSpec spec;
      spec.dim = 16;
      spec.heads = 2;
      spec.layout = TokenLayout{1, 70, 1, 1};
      spec.causal = true;
      spec.config.type = name;
      spec.config.blocks = 1;
      auto layer = type.make_layer(spec, type);
      auto x = torch::randn({2, 70, 16});
      auto changed = x.clone();
      changed.narrow(1, 40, 30).normal_();
      auto a = layer->forward(x), b = layer->forward(changed);
      CHECK(torch::allclose(a.narrow(1, 0, 40), b.narrow(1, 0, 40), 1e-6, 1e-6));
      CHECK_FALSE(torch::allclose(a.narrow(1, 40, 30), b.narrow(1, 40, 30), 1e-3, 1e-3));
    }
  }
  for (const char* name : {"gated_deltanet", "kda"}) {
    INFO(name << " bidirectional");
    const auto& type = attention_registry().get(name);
    AttentionSpec spec;
    spec.dim = 16;
    spec.heads = 2;
    spec.layout = TokenLayout{1, 50, 1, 1};
    spec.causal = false;
    spec.config.type = name;
    auto layer = type.make_layer(spec, type);
    auto x = torch::randn({1, 50, 16});
    auto changed = x.clone();
    changed.narrow(1, 45, 5).normal_();
    auto a = layer->forward(x), b = layer->forward(changed);
    CHECK_FALSE(torch::allclose(a.narrow(1, 0, 10), b.narrow(1, 0, 10), 1e-4, 1e-4));
  }
}

namespace {

// Dense masked O(N^2) form of causal linear / MHLA attention from an explicit block-weight matrix.
torch::Tensor dense_causal(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                           const torch::Tensor& block_weights /* [nb, nb] */) {
  const auto n = q.size(1);
  auto block = torch::div(torch::arange(n, torch::kLong), kCausalBlock, "floor");
  auto weights = block_weights.index({block.unsqueeze(1), block.unsqueeze(0)}) *
                 torch::ones({n, n}, q.options()).tril();
  return dense_weighted(q, k, v, weights);
}

}  // namespace

TEST_CASE("attention: causal linear and MHLA references equal dense masked formulas (float64)", "[attention]") {
  torch::manual_seed(41);
  for (int64_t n : {40, 64, 150, 300}) {
    INFO("N = " << n);
    auto q = torch::randn({2, n, 2, 8}, f64()), k = torch::randn({2, n, 2, 8}, f64());
    auto v = torch::randn({2, n, 2, 8}, f64()), up = torch::randn({2, n, 2, 8}, f64());
    const int64_t nb = (n + kCausalBlock - 1) / kCausalBlock;
    auto ours = run_with_grads([](auto q_, auto k_, auto v_, auto) {
      return causal_linear_attention_reference(q_, k_, v_);
    }, q, k, v, {}, up);
    auto dense = run_with_grads([&](auto q_, auto k_, auto v_, auto) {
      return dense_causal(q_, k_, v_, torch::ones({nb, nb}, f64()));
    }, q, k, v, {}, up);
    check_close(ours, dense, 1e-10);
    // MHLA with a trained length of 3 blocks: N = 300 (5 blocks) exercises the long policy.
    auto mixing = torch::rand({3, 3}, f64()).tril() + 0.1 * torch::eye(3, f64());
    auto ours_mhla = run_with_grads([](auto q_, auto k_, auto v_, auto m_) {
      return causal_mhla_reference(q_, k_, v_, m_);
    }, q, k, v, mixing, up);
    auto dense_mhla = run_with_grads([&](auto q_, auto k_, auto v_, auto m_) {
      return dense_causal(q_, k_, v_, causal_mixing_matrix(m_, nb));
    }, q, k, v, mixing, up);
    check_close(ours_mhla, dense_mhla, 1e-9);  // d(mixing) sums many terms: float64 noise ~1e-10
  }
}

TEST_CASE("attention: the long-sequence mixing policy", "[attention]") {
  auto m = torch::tensor({{1.0, 0.0, 0.0}, {0.5, 0.9, 0.0}, {0.2, 0.3, 0.8}}, f64());
  auto within = causal_mixing_matrix(m, 2);
  CHECK(torch::equal(within, m.narrow(0, 0, 2).narrow(1, 0, 2)));
  auto e = causal_mixing_matrix(m, 5);
  auto expected = torch::tensor({{1.0, 0.0, 0.0, 0.0, 0.0},
                                 {0.5, 0.9, 0.0, 0.0, 0.0},
                                 {0.2, 0.3, 0.8, 0.0, 0.0},
                                 {0.2, 0.2, 0.3, 0.8, 0.0},   // blocks 0-1 share m_{2,0}
                                 {0.2, 0.2, 0.2, 0.3, 0.8}},
                                f64());
  CHECK(torch::equal(e, expected));
  // The upper triangle of the learned matrix never leaks in.
  auto noisy = m + torch::triu(torch::ones({3, 3}, f64()), 1);
  CHECK(torch::equal(causal_mixing_matrix(noisy, 5), expected));
}

TEST_CASE("attention: causal MHLA with all-ones mixing is causal linear attention", "[attention]") {
  torch::manual_seed(42);
  auto q = torch::randn({1, 200, 2, 16}, f64()), k = torch::randn({1, 200, 2, 16}, f64());
  auto v = torch::randn({1, 200, 2, 16}, f64());
  auto ones = torch::ones({4, 4}, f64()).tril();
  CHECK(test::relative_error(causal_mhla_reference(q, k, v, ones),
                             causal_linear_attention_reference(q, k, v)) < 1e-12);
}

TEST_CASE("attention: causal MHLA mixing starts uniform 1/(i+1) and stays lower-triangular in [1e-5, 1]", "[attention]") {
  const auto& type = attention_registry().get("mhla");
  AttentionSpec spec;
  spec.dim = 16;
  spec.heads = 2;
  spec.layout = TokenLayout{1, 256, 1, 1};
  spec.causal = true;
  spec.config.blocks = 4;
  auto layer = std::dynamic_pointer_cast<MhlaLayerImpl>(type.make_layer(spec, type));
  REQUIRE(layer);
  auto expected = torch::tensor({{1.0, 0.0, 0.0, 0.0},
                                 {0.5, 0.5, 0.0, 0.0},
                                 {1.0 / 3, 1.0 / 3, 1.0 / 3, 0.0},
                                 {0.25, 0.25, 0.25, 0.25}});
  CHECK(test::relative_error(layer->mixing(), expected) < 1e-7);
  {
    torch::NoGradGuard no_grad;
    layer->mixing().copy_(torch::full({4, 4}, -2.0));
    layer->mixing()[3][1] = 7.0;
  }
  layer->project_parameters();
  CHECK(layer->mixing()[0][0].item<double>() == Approx(1e-5));
  CHECK(layer->mixing()[3][1].item<double>() == 1.0);
  CHECK(layer->mixing()[0][3].item<double>() == 0.0);
  CHECK(layer->mixing().triu(1).abs().sum().item<double>() == 0.0);
}

TEST_CASE("attention: the long-sequence mixing matrix and its gradient match the row-by-row construction", "[attention]") {
  // The policy as first written, one row at a time (the oracle for the gathered form).
  auto row_by_row = [](const torch::Tensor& mixing, int64_t blocks) {
    const int64_t m = mixing.size(0);
    auto lower = mixing.tril();
    auto last = lower[m - 1];
    std::vector<torch::Tensor> rows = {torch::cat({lower, torch::zeros({m, blocks - m}, mixing.options())}, 1)};
    for (int64_t i = m; i < blocks; ++i) {
      const int64_t window_start = i - m + 1;
      rows.push_back(torch::cat({last.narrow(0, 0, 1).expand({window_start + 1}), last.narrow(0, 1, m - 1),
                                 torch::zeros({blocks - i - 1}, mixing.options())})
                         .unsqueeze(0));
    }
    return torch::cat(rows, 0);
  };
  torch::manual_seed(12);
  for (int64_t m : {1, 3, 16}) {
    for (int64_t blocks : {m + 1, 3 * m + 2, int64_t{64}}) {
      INFO("M = " << m << ", blocks = " << blocks);
      auto mixing = torch::rand({m, m}, f64());
      auto upstream = torch::randn({blocks, blocks}, f64());
      auto a = mixing.clone().requires_grad_(true), b = mixing.clone().requires_grad_(true);
      auto ours = causal_mixing_matrix(a, blocks), expected = row_by_row(b, blocks);
      CHECK(torch::equal(ours, expected));
      (ours * upstream).sum().backward();
      (expected * upstream).sum().backward();
      CHECK(test::relative_error(a.grad(), b.grad()) < 1e-14);
    }
  }
}
