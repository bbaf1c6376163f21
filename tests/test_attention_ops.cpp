// The op-test harness (in the spirit of ggml's test-backend-ops): every registered attention op,
// every backend available here, a list of shapes with the edge cases, outputs and all gradients
// against the reference computed in float32 on the CPU from the same (rounded) inputs.
// Relative RMS error ||a - b|| / ||b||: outputs 5e-3, dq/dk/dv 8e-3, mixing 2e-2 (bf16 inputs).
#include "attention/attention_type.h"
#include "catch_compat.h"
#include "test_helpers.h"

using namespace mhla;

namespace {

struct OpShape {
  const char* what;
  int64_t batch, heads, tokens, head_dim, blocks;
  double scale = 1.0;
};

const OpShape kShapes[] = {
    {"basic", 2, 3, 64, 32, 4},
    {"N not a multiple of a 64-token tile", 2, 2, 100, 64, 4},
    {"N smaller than one tile", 3, 2, 12, 32, 4},
    {"one block", 2, 2, 96, 64, 1},
    {"D = 128", 1, 2, 64, 128, 16},
    {"64 blocks", 1, 1, 256, 32, 64},
    {"large magnitude", 2, 2, 64, 64, 4, 30.0},
    {"large B*H", 16, 16, 32, 32, 4},
    {"long blocks (several GPU chunks per block)", 1, 2, 1200, 64, 2},
    {"16 blocks of 16 tokens (the vision shape; resident kernels)", 2, 3, 256, 64, 16},
    {"D = 32 at 512 tokens (resident kernels)", 1, 2, 512, 32, 8},
    {"more causal blocks (12) than trained (3): the long-sequence policy", 1, 2, 768, 64, 3},
};

struct Result {
  torch::Tensor out, dq, dk, dv;
  std::vector<std::pair<std::string, torch::Tensor>> extra;  // d(mixing), d(beta), d(gate)
};

Result run(const OpFn& op, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
           const OpArgs& base_args, const torch::Tensor& grad_out, const torch::Device& device,
           torch::ScalarType dtype) {
  auto to = [&](const torch::Tensor& t) {
    return t.to(device, dtype).detach().requires_grad_(true);
  };
  auto qd = to(q), kd = to(k), vd = to(v);
  OpArgs args = base_args;
  const std::pair<const char*, torch::Tensor*> extras[] = {
      {"mixing", &args.mixing}, {"beta", &args.beta}, {"gate", &args.gate}};
  for (auto [name, t] : extras) {
    if (t->defined()) *t = t->to(device, torch::kFloat32).detach().requires_grad_(true);
  }
  auto out = op(qd, kd, vd, args);
  out.backward(grad_out.to(device, dtype));
  Result r{out.detach().cpu(), qd.grad().cpu(), kd.grad().cpu(), vd.grad().cpu(), {}};
  for (auto [name, t] : extras) {
    if (t->defined()) r.extra.emplace_back(name, t->grad().cpu());
  }
  return r;
}

void check_backend(const std::string& name, const AttentionType& type, const std::string& backend,
                   const torch::Device& device, torch::ScalarType dtype) {
  for (bool causal : type.causal_modes) {
    if (causal && type.bidirectional_only.count(backend)) continue;
    for (const auto& shape : kShapes) {
      INFO(name << " / " << backend << " on " << device.str() << " in " << c10::toString(dtype)
                << (causal ? ", causal: " : ": ")
                << shape.what << " (B=" << shape.batch << " H=" << shape.heads << " N="
                << shape.tokens << " D=" << shape.head_dim << " M=" << shape.blocks << ")");
      const std::vector<int64_t> dims = {shape.batch, shape.tokens, shape.heads, shape.head_dim};
      // Inputs rounded to the tested dtype once, so both sides see the same numbers. Large
      // magnitudes go into q and k only where the op normalizes them (softmax would saturate and
      // its gradients vanish into rounding), and into v everywhere.
      const double qk_scale = type.normalizes_qk ? shape.scale : 1.0;
      // Delta-rule ops get unit q and k, as their layers give them: with raw normals
      // (I - beta k k^T) has eigenvalues far below -1 and long sequences overflow.
      auto unit = [&](torch::Tensor x) {
        return type.unit_qk ? x / x.norm(2, {-1}, /*keepdim=*/true) : x;
      };
      auto q = unit(torch::randn(dims) * qk_scale).to(dtype).to(torch::kFloat32);
      auto k = unit(torch::randn(dims) * qk_scale).to(dtype).to(torch::kFloat32);
      auto v = (torch::randn(dims) * shape.scale).to(dtype).to(torch::kFloat32);
      auto grad_out = torch::randn(dims).to(dtype).to(torch::kFloat32);
      OpArgs args = type.make_args({shape.batch, shape.tokens, shape.heads, shape.head_dim,
                                    shape.blocks, causal},
                                   torch::TensorOptions());
      auto expected = run(type.backends.at("reference"), q, k, v, args, grad_out, torch::kCPU,
                          torch::kFloat32);
      auto got = run(select_backend(name, type, backend, device, "test", causal), q, k, v, args,
                     grad_out,
                     device, dtype);
      REQUIRE(got.out.sizes() == expected.out.sizes());
      CHECK(got.out.isfinite().all().item<bool>());
      CHECK(test::relative_error(got.out, expected.out) < 5e-3);
      CHECK(test::relative_error(got.dq, expected.dq) < 8e-3);
      CHECK(test::relative_error(got.dk, expected.dk) < 8e-3);
      CHECK(test::relative_error(got.dv, expected.dv) < 8e-3);
      REQUIRE(got.extra.size() == expected.extra.size());
      for (size_t i = 0; i < got.extra.size(); ++i) {
        INFO("d" << got.extra[i].first);
        auto g = got.extra[i].second, e = expected.extra[i].second;
        if (got.extra[i].first == "mixing") {
          // The normalized output does not change when a row of the mixing matrix is scaled, so
          // the gradient along each row's own direction is zero up to rounding; compare the rest.
          // With one block in use (M = 1, one causal chunk) nothing is left to compare.
          auto m = args.mixing.to(torch::kFloat32);
          auto project = [&](const torch::Tensor& x) {
            return x - (x * m).sum(1, true) / (m * m).sum(1, true) * m;
          };
          g = project(g), e = project(e);
          if (e.norm().item<double>() <= 1e-2 * expected.extra[i].second.norm().item<double>() + 1e-12) continue;
        }
        CHECK(test::relative_error(g, e) < 2e-2);
      }
    }
  }
}

}  // namespace

TEST_CASE("ops: every op and CPU backend on bf16 inputs matches the float32 reference", "[attention]") {
  torch::manual_seed(11);
  for (const auto& [name, type] : attention_registry().entries()) {
    for (const auto& [backend, fn] : type.backends) {
      if (backend == "reference") {
        check_backend(name, type, backend, torch::kCPU, torch::kBFloat16);
      }
    }
  }
}

TEST_CASE("ops: every op and GPU backend on bf16, fp16 and fp32 inputs matches the float32 reference", "[attention][gpu]") {
  if (!torch::cuda::is_available()) {
    WARN("no CUDA device: skipped");
    return;
  }
  torch::manual_seed(12);
  for (auto dtype : {torch::kBFloat16, torch::kFloat16, torch::kFloat32}) {
    for (const auto& [name, type] : attention_registry().entries()) {
      for (const auto& [backend, fn] : type.backends) {
        check_backend(name, type, backend, torch::Device(torch::kCUDA, 0), dtype);
      }
    }
  }
}

TEST_CASE("ops: GPU backends read strided q/k/v views (the fused QKV layout) exactly like copies", "[attention][gpu]") {
  if (!torch::cuda::is_available()) {
    WARN("no CUDA device: skipped");
    return;
  }
  torch::manual_seed(13);
  auto options = torch::TensorOptions().device(torch::kCUDA).dtype(torch::kBFloat16);
  for (const char* name : {"linear", "mhla"}) {
    const auto& type = attention_registry().get(name);
    for (const auto& [backend, fn] : type.backends) {
      if (backend == "reference") continue;  // it copies its inputs first; the kernels read views
      for (bool causal : {false, true}) {
        if (causal && backend != "cuda") continue;  // the causal kernels of the `cuda` backend
        INFO(name << " / " << backend << (causal ? " (causal)" : ""));
        const int64_t b = 3, n = 96, h = 2, d = 64;
        OpArgs args = type.make_args({b, n, h, d, 4, causal}, torch::TensorOptions().device(torch::kCUDA));
        auto qkv = torch::randn({b, n, 3, h, d}, options).requires_grad_(true);  // [B, N, 3, H, D]
        auto grad_out = torch::randn({b, n, h, d}, options);
        auto strided = fn(qkv.select(2, 0), qkv.select(2, 1), qkv.select(2, 2), args);
        strided.backward(grad_out);
        std::vector<torch::Tensor> copies;
        for (int i = 0; i < 3; ++i) copies.push_back(qkv.select(2, i).detach().contiguous().requires_grad_(true));
        auto dense = fn(copies[0], copies[1], copies[2], args);
        dense.backward(grad_out);
        CHECK(torch::equal(strided, dense));
        for (int i = 0; i < 3; ++i) CHECK(torch::equal(qkv.grad().select(2, i), copies[i].grad()));
      }
    }
  }
}
