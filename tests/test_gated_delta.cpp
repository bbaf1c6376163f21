// Gated DeltaNet / KDA references: the chunked WY form against the token-by-token recurrence
// (float64: outputs, final states and every gradient), closed forms, decode and prefill+decode.
#include <cstdlib>
#include <optional>
#include <string>

#include "attention/delta_chunk_recurrence.h"
#include "attention/gated_delta.h"
#include "attention/gated_delta_decode.h"
#include "attention/gated_delta_fused.h"
#include "catch_compat.h"
#include "core/error.h"
#include "test_helpers.h"

#ifdef MHLA_WITH_CUDA_KERNELS
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "gated_delta/chunk_fused.h"
#endif

using namespace mhla;

namespace {

auto f64() {
  return torch::TensorOptions().dtype(torch::kFloat64);
}

struct Inputs {
  torch::Tensor q, k, v, beta, g, s0;
};

// L2-normalized q, k (as the layer gives them), beta in (0, 1), g <= 0 at the given strength.
Inputs make_inputs(int64_t b, int64_t t, int64_t h, int64_t dk, int64_t dv, double gate_scale,
                   bool per_key_gate, bool initial_state) {
  Inputs in;
  in.q = torch::nn::functional::normalize(torch::randn({b, t, h, dk}, f64()),
                                          torch::nn::functional::NormalizeFuncOptions().dim(-1));
  in.k = torch::nn::functional::normalize(torch::randn({b, t, h, dk}, f64()),
                                          torch::nn::functional::NormalizeFuncOptions().dim(-1));
  in.v = torch::randn({b, t, h, dv}, f64());
  in.beta = torch::sigmoid(torch::randn({b, t, h}, f64()));
  in.g = per_key_gate ? -gate_scale * torch::rand({b, t, h, dk}, f64())
                      : -gate_scale * torch::rand({b, t, h}, f64());
  if (initial_state) in.s0 = torch::randn({b, h, dk, dv}, f64());
  return in;
}

std::vector<torch::Tensor> leaves(Inputs& in) {
  std::vector<torch::Tensor> out = {in.q, in.k, in.v, in.beta, in.g};
  if (in.s0.defined()) out.push_back(in.s0);
  for (auto& t : out) t = t.detach().clone().requires_grad_(true);
  return out;
}

// Outputs and the gradients of a fixed random projection of (out, final state).
std::vector<torch::Tensor> outputs_and_grads(bool chunked, Inputs in, double scale, int64_t chunk,
                                             const torch::Tensor& w_out,
                                             const torch::Tensor& w_state) {
  auto x = leaves(in);
  torch::Tensor s0 = x.size() > 5 ? x[5] : torch::Tensor();
  auto r = chunked ? delta_rule_chunked(x[0], x[1], x[2], x[3], x[4], s0, scale, chunk)
                   : delta_rule_recurrent(x[0], x[1], x[2], x[3], x[4], s0, scale);
  ((r.out * w_out).sum() + (r.final_state * w_state).sum()).backward();
  std::vector<torch::Tensor> result = {r.out.detach(), r.final_state.detach()};
  for (auto& leaf : x) result.push_back(leaf.grad());
  return result;
}

}  // namespace

TEST_CASE("delta rule: chunked equals the recurrence, values and gradients (float64)",
          "[attention]") {
  torch::manual_seed(21);
  struct Case {
    const char* what;
    int64_t t;
    double gate;
    bool per_key, s0;
  };
  for (const auto& c :
       {Case{"no decay (g = 0)", 150, 0.0, false, true},
        Case{"moderate decay", 150, 0.5, false, true}, Case{"strong decay", 130, 8.0, false, false},
        Case{"KDA per-key gates", 150, 0.5, true, true},
        Case{"KDA strong decay", 70, 8.0, true, true},
        Case{"shorter than a chunk", 20, 0.3, true, false}}) {
    INFO(c.what);
    auto in = make_inputs(2, c.t, 2, 16, 24, c.gate, c.per_key, c.s0);
    auto w_out = torch::randn({2, c.t, 2, 24}, f64()),
         w_state = torch::randn({2, 2, 16, 24}, f64());
    const double scale = 1.0 / std::sqrt(16.0);
    auto rec = outputs_and_grads(false, in, scale, 64, w_out, w_state);
    auto chk = outputs_and_grads(true, in, scale, 64, w_out, w_state);
    const char* names[] = {"out", "final state", "dq", "dk", "dv", "dbeta", "dg", "dh0"};
    for (size_t i = 0; i < rec.size(); ++i) {
      INFO(names[i]);
      CHECK(test::relative_error(chk[i], rec[i]) < 1e-9);
    }
  }
}

TEST_CASE("delta rule: the chunk size does not change the result", "[attention]") {
  torch::manual_seed(22);
  // Per-key gates (KDA, chunk by chunk) and one gate per head (gated DeltaNet, all chunks at
  // once, the sequence padded to whole chunks: 100 tokens in chunks of 7, 32 or 128).
  for (const bool per_key : {true, false}) {
    INFO((per_key ? "per-key gates" : "per-head gates"));
    auto in = make_inputs(1, 100, 2, 8, 8, 1.0, per_key, true);
    auto reference = delta_rule_chunked(in.q, in.k, in.v, in.beta, in.g, in.s0, 0.5, 64);
    for (int64_t chunk : {1, 7, 32, 100, 128}) {
      INFO("chunk " << chunk);
      auto r = delta_rule_chunked(in.q, in.k, in.v, in.beta, in.g, in.s0, 0.5, chunk);
      CHECK(test::relative_error(r.out, reference.out) < 1e-11);
      CHECK(test::relative_error(r.final_state, reference.final_state) < 1e-11);
    }
  }
}

TEST_CASE("delta rule: closed forms of one write and read", "[attention]") {
  // beta = 1, no decay, unit k: writing (k, v) into S0 then reading with q = k returns v.
  auto k = torch::nn::functional::normalize(torch::randn({1, 1, 1, 8}, f64()),
                                            torch::nn::functional::NormalizeFuncOptions().dim(-1));
  auto v = torch::randn({1, 1, 1, 5}, f64());
  auto s0 = torch::randn({1, 1, 8, 5}, f64());
  auto beta = torch::ones({1, 1, 1}, f64()), g = torch::zeros({1, 1, 1}, f64());
  auto r = delta_rule_chunked(k, k, v, beta, g, s0, 1.0);
  CHECK(test::relative_error(r.out, v) < 1e-12);
  // gated DeltaNet: S1 = exp(g) (I - k k^T) S0 + k v^T.
  auto gate = torch::full({1, 1, 1}, -0.7, f64());
  auto half = torch::full({1, 1, 1}, 0.5, f64());
  auto kk = k.view({8, 1});
  auto expected =
      std::exp(-0.7) * (torch::eye(8, f64()) - 0.5 * kk.matmul(kk.t())).matmul(s0.view({8, 5})) +
      0.5 * kk.matmul(v.view({1, 5}));
  auto step = delta_rule_recurrent(k, k, v, half, gate, s0, 1.0);
  CHECK(test::relative_error(step.final_state.view({8, 5}), expected) < 1e-12);
  // KDA with per-key gates: S1 = (I - b k k^T) Diag(exp g) S0 + b k v^T.
  auto gk = -torch::rand({1, 1, 1, 8}, f64());
  auto expected_kda = (torch::eye(8, f64()) - 0.5 * kk.matmul(kk.t()))
                          .matmul(torch::diag(gk.view({8}).exp()).matmul(s0.view({8, 5}))) +
                      0.5 * kk.matmul(v.view({1, 5}));
  auto kda = delta_rule_chunked(k, k, v, half, gk, s0, 1.0);
  CHECK(test::relative_error(kda.final_state.view({8, 5}), expected_kda) < 1e-12);
}

TEST_CASE("delta rule: chunked prefill then decode steps equal one pass", "[attention]") {
  torch::manual_seed(23);
  auto in = make_inputs(2, 90, 3, 16, 16, 0.7, false, false);
  const double scale = 0.25;
  auto full = delta_rule_chunked(in.q, in.k, in.v, in.beta, in.g, {}, scale);
  auto prefill =
      delta_rule_chunked(in.q.narrow(1, 0, 70), in.k.narrow(1, 0, 70), in.v.narrow(1, 0, 70),
                         in.beta.narrow(1, 0, 70), in.g.narrow(1, 0, 70), {}, scale);
  CHECK(test::relative_error(prefill.out, full.out.narrow(1, 0, 70)) < 1e-12);
  auto state = prefill.final_state.clone();
  for (int64_t t = 70; t < 90; ++t) {
    INFO("token " << t);
    auto o = delta_rule_step(state, in.q.select(1, t), in.k.select(1, t), in.v.select(1, t),
                             in.beta.select(1, t), in.g.select(1, t), scale);
    CHECK(test::relative_error(o, full.out.select(1, t)) < 1e-11);
  }
  CHECK(test::relative_error(state, full.final_state) < 1e-11);
}

TEST_CASE("delta rule: float32 and bf16 inputs keep a float32 state", "[attention]") {
  torch::manual_seed(24);
  auto in = make_inputs(1, 80, 2, 32, 32, 1.0, false, true);
  auto exact = delta_rule_chunked(in.q, in.k, in.v, in.beta, in.g, in.s0, 0.2);
  auto bf = [](const torch::Tensor& t) { return t.to(torch::kBFloat16); };
  auto low = delta_rule_chunked(bf(in.q), bf(in.k), bf(in.v), bf(in.beta), in.g.to(torch::kFloat32),
                                in.s0.to(torch::kFloat32), 0.2);
  CHECK(low.out.scalar_type() == torch::kBFloat16);
  CHECK(low.final_state.scalar_type() == torch::kFloat32);
  CHECK(test::relative_error(low.out, exact.out) < 2e-2);
  CHECK(test::relative_error(low.final_state, exact.final_state) < 2e-2);
}

TEST_CASE("delta rule: the GPU decode kernel steps the state like the reference step",
          "[attention][gpu]") {
  if (!torch::cuda::is_available()) {
    WARN("no CUDA device: skipped");
    return;
  }
  struct Case {
    int64_t b, h, dk, dv;
    bool per_key_gate;
    torch::ScalarType dtype;
  };
  for (const auto& c :
       {Case{3, 2, 128, 128, false, torch::kBFloat16}, Case{3, 2, 128, 128, true, torch::kBFloat16},
        Case{2, 3, 64, 96, true, torch::kFloat32}, Case{1, 2, 256, 40, false, torch::kFloat16},
        Case{2, 1, 20, 33, true, torch::kFloat32}}) {
    INFO("B=" << c.b << " H=" << c.h << " Dk=" << c.dk << " Dv=" << c.dv << " per-key gate "
              << c.per_key_gate << " " << c.dtype);
    torch::manual_seed(31);
    auto cuda = torch::TensorOptions().device(torch::kCUDA);
    auto f32 = cuda.dtype(torch::kFloat32);
    auto kernel_state = torch::randn({c.b, c.h, c.dk, c.dv}, f32);
    auto reference_state = kernel_state.clone();
    for (int step = 0; step < 5; ++step) {
      auto unit = [](torch::Tensor x) { return x / x.norm(2, {-1}, true); };
      auto q = unit(torch::randn({c.b, c.h, c.dk}, f32)).to(c.dtype);
      auto k = unit(torch::randn({c.b, c.h, c.dk}, f32)).to(c.dtype);
      auto v = torch::randn({c.b, c.h, c.dv}, f32).to(c.dtype);
      auto beta = torch::rand({c.b, c.h}, f32);
      auto g = -torch::rand(
          c.per_key_gate ? std::vector<int64_t>{c.b, c.h, c.dk} : std::vector<int64_t>{c.b, c.h},
          f32);
      const double scale = 1.0 / std::sqrt(static_cast<double>(c.dk));
      auto before = kernel_state.data_ptr();
      auto o_kernel = delta_rule_decode(kernel_state, q, k, v, beta, g, scale);
      auto o_reference = delta_rule_step(reference_state, q, k, v, beta, g, scale);
      CHECK(kernel_state.data_ptr() == before);  // updated in place
      REQUIRE(o_kernel.scalar_type() == c.dtype);
      const double tolerance = c.dtype == torch::kFloat32 ? 1e-5 : 1e-2;
      CHECK(test::relative_error(o_kernel.to(torch::kFloat32).cpu(),
                                 o_reference.to(torch::kFloat32).cpu()) < tolerance);
      CHECK(test::relative_error(kernel_state.cpu(), reference_state.cpu()) < 1e-5);
    }
  }
}

namespace {

struct RecurrenceInputs {
  torch::Tensor u0, w, kt, decay, s0;
};

RecurrenceInputs recurrence_inputs(int64_t b, int64_t h, int64_t n, int64_t c, int64_t dk,
                                   int64_t dv, torch::TensorOptions options) {
  // W and Kt scaled so that the carried state neither explodes nor vanishes over the chunks.
  const double scale = 0.5 / std::sqrt(static_cast<double>(c * dk));
  return {torch::randn({b, h, n, c, dv}, options), torch::randn({b, h, n, c, dk}, options) * scale,
          torch::randn({b, h, n, c, dk}, options) * scale,
          torch::rand({b, h, n, dk}, options) * 0.5 + 0.5, torch::randn({b, h, dk, dv}, options)};
}

// Values of the three outputs and gradients of the five inputs under fixed upstream weights.
std::vector<torch::Tensor> recurrence_values_and_grads(const RecurrenceInputs& in, bool reference) {
  std::vector<torch::Tensor> leaves;
  for (const auto* t : {&in.u0, &in.w, &in.kt, &in.decay, &in.s0}) {
    leaves.push_back(t->detach().clone().requires_grad_(true));
  }
  auto run = reference ? delta_chunk_recurrence_reference : delta_chunk_recurrence;
  auto out = run(leaves[0], leaves[1], leaves[2], leaves[3], leaves[4]);
  torch::manual_seed(77);
  auto weights = [&](const torch::Tensor& t) {
    return torch::randn(t.sizes(), t.options().device(torch::kCPU)).to(t.device());
  };
  auto loss = (out.states * weights(out.states)).sum() + (out.u * weights(out.u)).sum() +
              (out.final * weights(out.final)).sum();
  auto grads = torch::autograd::grad({loss}, leaves);
  std::vector<torch::Tensor> all = {out.states.detach(), out.u.detach(), out.final.detach()};
  all.insert(all.end(), grads.begin(), grads.end());
  return all;
}

}  // namespace

TEST_CASE("delta rule: the chunk-to-chunk recurrence's own backward equals autograd of its loop",
          "[attention]") {
  torch::manual_seed(41);
  auto in = recurrence_inputs(2, 3, 4, 5, 6, 7, torch::TensorOptions().dtype(torch::kFloat64));
  auto ours = recurrence_values_and_grads(in, true);
  // The same recurrence written as plain ops, differentiated by autograd.
  std::vector<torch::Tensor> leaves;
  for (const auto* t : {&in.u0, &in.w, &in.kt, &in.decay, &in.s0}) {
    leaves.push_back(t->detach().clone().requires_grad_(true));
  }
  auto state = leaves[4];
  std::vector<torch::Tensor> states, us;
  for (int64_t i = 0; i < 4; ++i) {
    states.push_back(state);
    auto u = leaves[0].select(2, i) - torch::matmul(leaves[1].select(2, i), state);
    us.push_back(u);
    state = leaves[3].select(2, i).unsqueeze(-1) * state +
            torch::matmul(leaves[2].select(2, i).transpose(-1, -2), u);
  }
  auto all_states = torch::stack(states, 2), all_u = torch::stack(us, 2);
  torch::manual_seed(77);
  auto loss = (all_states * torch::randn(all_states.sizes(), torch::kFloat64)).sum() +
              (all_u * torch::randn(all_u.sizes(), torch::kFloat64)).sum() +
              (state * torch::randn(state.sizes(), torch::kFloat64)).sum();
  auto grads = torch::autograd::grad({loss}, leaves);
  std::vector<torch::Tensor> expected = {all_states, all_u, state};
  expected.insert(expected.end(), grads.begin(), grads.end());
  const char* names[] = {"states", "u", "final", "du0", "dw", "dkt", "ddecay", "ds0"};
  for (size_t i = 0; i < expected.size(); ++i) {
    INFO(names[i]);
    CHECK(test::relative_error(ours[i], expected[i].detach()) < 1e-12);
  }
  CHECK_THROWS(delta_chunk_recurrence(in.u0, in.w, in.kt, in.decay.narrow(3, 0, 5), in.s0));
}

TEST_CASE("delta rule: the chunk-recurrence kernels equal the reference loop, values and gradients",
          "[attention][gpu]") {
  if (!torch::cuda::is_available()) {
    WARN("no CUDA device: skipped");
    return;
  }
  struct Case {
    int64_t b, h, n, c, dk, dv;
  };
  // A partial 32-column tile (Dv = 100), short chunks, the widest key dimension, the LM shape.
  for (const auto& s : {Case{2, 3, 5, 64, 128, 100}, Case{1, 2, 3, 16, 8, 32},
                        Case{1, 1, 2, 64, 256, 64}, Case{1, 2, 9, 64, 128, 128}}) {
    INFO("B=" << s.b << " H=" << s.h << " n=" << s.n << " C=" << s.c << " Dk=" << s.dk
              << " Dv=" << s.dv);
    torch::manual_seed(43);
    auto in = recurrence_inputs(s.b, s.h, s.n, s.c, s.dk, s.dv,
                                torch::TensorOptions().device(torch::kCUDA));
    REQUIRE(delta_chunk_recurrence_uses_kernel(in.u0, in.w));
    auto kernel = recurrence_values_and_grads(in, false);
    auto reference = recurrence_values_and_grads(in, true);
    const char* names[] = {"states", "u", "final", "du0", "dw", "dkt", "ddecay", "ds0"};
    for (size_t i = 0; i < kernel.size(); ++i) {
      INFO(names[i]);
      CHECK(test::relative_error(kernel[i].cpu(), reference[i].cpu()) < 1e-4);
    }
  }
}

TEST_CASE("delta rule: the unit-lower solve inverts I + A, values and gradients", "[attention]") {
  auto f64 = torch::TensorOptions().dtype(torch::kFloat64);
  for (int64_t c : {1, 2, 5, 16, 64}) {
    INFO("chunk " << c);
    torch::manual_seed(c);
    // As in the delta rule: A_rs = beta_r k_r . k_s decay_rs for s < r, unit keys, beta in (0, 1).
    auto k = torch::nn::functional::normalize(
        torch::randn({3, 2, c, 16}, f64), torch::nn::functional::NormalizeFuncOptions().dim(-1));
    auto beta = torch::rand({3, 2, c, 1}, f64);
    auto decay = torch::rand({3, 2, c, c}, f64);
    auto a = (beta * torch::matmul(k, k.transpose(-1, -2)) * decay).tril(-1).requires_grad_(true);
    auto rhs = torch::randn({3, 2, c, 24}, f64).requires_grad_(true);
    auto solved = unit_lower_solve(a, rhs);
    auto inverse = torch::matmul(torch::linalg_inv(torch::eye(c, f64) + a), rhs);
    CHECK(test::relative_error(solved, inverse) < 1e-12);
    auto up = torch::randn_like(solved);
    auto grads_solved = torch::autograd::grad({(solved * up).sum()}, {a, rhs});
    auto grads_inverse = torch::autograd::grad({(inverse * up).sum()}, {a, rhs});
    CHECK(test::relative_error(grads_solved[1], grads_inverse[1]) < 1e-12);
    // dA of the solve is dense; only its lower part is A's (strictly lower) gradient.
    CHECK(test::relative_error(grads_solved[0].tril(-1), grads_inverse[0].tril(-1)) < 1e-12);
  }
}

TEST_CASE(
    "delta rule: the fused gated DeltaNet and KDA kernels equal the reference, values and "
    "gradients",
    "[attention][gpu]") {
  if (!torch::cuda::is_available()) {
    WARN("no CUDA device: skipped");
    return;
  }
  struct Case {
    const char* what;
    int64_t b, t, h, d;
    double gate_scale;
    bool initial_state;
    torch::ScalarType dtype;
    bool per_key = false;  // KDA
  };
  // fla's tolerances (relative RMS): o and final state 5e-3, dq/dk/dv/dh0 8e-3, dbeta/dg 2e-2.
  const Case cases[] = {
      {"T not a multiple of 64, initial state", 2, 300, 3, 128, 1.0, true, torch::kBFloat16},
      {"no decay (g = 0)", 1, 256, 2, 128, 0.0, false, torch::kBFloat16},
      {"strong decay", 2, 200, 2, 64, 8.0, true, torch::kBFloat16},
      {"fewer tokens than a chunk", 3, 17, 2, 64, 1.0, true, torch::kBFloat16},
      {"fp16, D = 64, many chunks", 1, 1000, 2, 64, 0.5, false, torch::kFloat16},
      {"KDA: T not a multiple of 64, initial state", 2, 300, 3, 128, 1.0, true, torch::kBFloat16,
       true},
      {"KDA: no decay (g = 0)", 1, 256, 2, 128, 0.0, false, torch::kBFloat16, true},
      {"KDA: strong decay", 2, 200, 2, 64, 8.0, true, torch::kBFloat16, true},
      // Sub-chunk decays around the kernels' bound (60 nats in 16 tokens): some chunks take the
      // tensor-core diagonal blocks, others the element-by-element ones.
      {"KDA: decay near the sub-chunk bound", 2, 300, 2, 128, 6.0, true, torch::kBFloat16, true},
      {"KDA: fewer tokens than a chunk", 3, 17, 2, 64, 1.0, true, torch::kBFloat16, true},
      {"KDA: fp16, D = 64, many chunks", 1, 1000, 2, 64, 0.5, false, torch::kFloat16, true},
      // More chunks than the GPU has SMs: the persistent chunk-gradient CTAs take several each
      // (every case above has fewer chunks than SMs); and DiT-S/2's shape (batch 256, 6 heads,
      // 256 tokens, D = 64), where gated DeltaNet training diverged in session 17.
      {"several chunks per CTA, D = 128", 48, 256, 4, 128, 1.0, true, torch::kBFloat16},
      {"several chunks per CTA, D = 64", 48, 256, 4, 64, 1.0, true, torch::kBFloat16},
      {"DiT-S/2 shape", 256, 256, 6, 64, 1.0, false, torch::kBFloat16},
      {"KDA: DiT-S/2 shape", 256, 256, 6, 64, 1.0, false, torch::kBFloat16, true},
  };
  for (const auto& c : cases) {
    INFO(c.what << " (B=" << c.b << " T=" << c.t << " H=" << c.h << " D=" << c.d << ")");
    torch::manual_seed(7);
    auto in = make_inputs(c.b, c.t, c.h, c.d, c.d, c.gate_scale, c.per_key, c.initial_state);
    // Both sides see the inputs rounded to the kernels' dtype.
    for (auto* x : {&in.q, &in.k, &in.v}) *x = x->to(c.dtype).to(torch::kFloat64);
    const double scale = 1.0 / std::sqrt(static_cast<double>(c.d));
    auto w_out = torch::randn({c.b, c.t, c.h, c.d}, f64()).to(c.dtype).to(torch::kFloat64);
    auto w_state = torch::randn({c.b, c.h, c.d, c.d}, f64());
    auto expected = outputs_and_grads(true, in, scale, 64, w_out, w_state);

    auto cuda = torch::TensorOptions().device(torch::kCUDA);
    auto leaf = [&](const torch::Tensor& x, torch::ScalarType type) {
      return x.to(cuda.dtype(type)).detach().requires_grad_(true);
    };
    auto q = leaf(in.q, c.dtype), k = leaf(in.k, c.dtype), v = leaf(in.v, c.dtype);
    auto beta = leaf(in.beta, torch::kFloat32), g = leaf(in.g, torch::kFloat32);
    torch::Tensor s0 = c.initial_state ? leaf(in.s0, torch::kFloat32) : torch::Tensor();
    REQUIRE(gated_delta_fused_takes(q, k, v, g));
    auto r = gated_delta_fused(q, k, v, beta, g, s0, scale);
    CHECK(r.out.scalar_type() == c.dtype);
    CHECK(r.final_state.scalar_type() == torch::kFloat32);
    ((r.out.to(torch::kFloat32) * w_out.to(cuda.dtype(torch::kFloat32))).sum() +
     (r.final_state * w_state.to(cuda.dtype(torch::kFloat32))).sum())
        .backward();
    std::vector<torch::Tensor> got = {r.out,    r.final_state, q.grad(), k.grad(),
                                      v.grad(), beta.grad(),   g.grad()};
    if (c.initial_state) got.push_back(s0.grad());
    const char* names[] = {"o", "final state", "dq", "dk", "dv", "dbeta", "dg", "dh0"};
    const double tolerance[] = {5e-3, 5e-3, 8e-3, 8e-3, 8e-3, 2e-2, 2e-2, 8e-3};
    REQUIRE(got.size() == expected.size());
    for (size_t i = 0; i < got.size(); ++i) {
      INFO(names[i]);
      REQUIRE(got[i].defined());
      auto x = got[i].to(torch::kCPU, torch::kFloat64);
      CHECK(x.isfinite().all().item<bool>());
      CHECK(test::relative_error(x, expected[i]) < tolerance[i]);
    }
  }
}

#ifdef MHLA_WITH_CUDA_KERNELS
namespace {

using test::ScopedEnv;

// The fused kernels' leaves on the GPU (bf16 q, k, v; fp32 beta, g and initial state) and fixed
// weights for a loss over the output and the final state.
struct FusedLeaves {
  torch::Tensor q, k, v, beta, g, s0, w_out, w_state;

  explicit FusedLeaves(const Inputs& in) {
    auto cuda = torch::TensorOptions().device(torch::kCUDA);
    auto leaf = [&](const torch::Tensor& x, torch::ScalarType type) {
      return x.to(cuda.dtype(type)).detach().requires_grad_(true);
    };
    q = leaf(in.q, torch::kBFloat16), k = leaf(in.k, torch::kBFloat16);
    v = leaf(in.v, torch::kBFloat16);
    beta = leaf(in.beta, torch::kFloat32), g = leaf(in.g, torch::kFloat32);
    s0 = leaf(in.s0, torch::kFloat32);
    torch::manual_seed(11);
    w_out = torch::randn(in.v.sizes(), cuda.dtype(torch::kFloat32));
    w_state = torch::randn(in.s0.sizes(), cuda.dtype(torch::kFloat32));
  }

  // New values in place (the tensors a captured graph reads).
  void assign(const Inputs& in) {
    torch::NoGradGuard no_grad;
    for (auto [leaf, value] :
         {std::pair{&q, &in.q}, std::pair{&k, &in.k}, std::pair{&v, &in.v},
          std::pair{&beta, &in.beta}, std::pair{&g, &in.g}, std::pair{&s0, &in.s0}}) {
      leaf->copy_(*value);
    }
  }

  // One forward+backward: the output, the final state and the seven gradients (fresh gradient
  // tensors each time).
  std::vector<torch::Tensor> step(double scale) {
    for (auto* x : {&q, &k, &v, &beta, &g, &s0}) x->mutable_grad().reset();
    auto r = gated_delta_fused(q, k, v, beta, g, s0, scale);
    ((r.out.to(torch::kFloat32) * w_out).sum() + (r.final_state * w_state).sum()).backward();
    return {r.out, r.final_state, q.grad(), k.grad(), v.grad(), beta.grad(), g.grad(), s0.grad()};
  }
};

const char* const kFusedResultNames[] = {"o",  "final state", "dq", "dk",
                                         "dv", "dbeta",       "dg", "dh0"};

}  // namespace
#endif

TEST_CASE(
    "delta rule: the fused kernels' walks cut into pipelined segments give the same results bit "
    "for bit",
    "[attention][gpu]") {
  if (!torch::cuda::is_available()) {
    WARN("no CUDA device: skipped");
    return;
  }
#ifdef MHLA_WITH_CUDA_KERNELS
  struct Case {
    const char* what;
    int64_t b, t, h, d;
    bool per_key;
  };
  // Segments of unequal lengths (T = 1,000: 16 chunks, the last partial), both state widths and
  // both variants, an initial state and a final-state gradient crossing every boundary.
  const Case cases[] = {{"gated DeltaNet, D = 128", 1, 1000, 2, 128, false},
                        {"gated DeltaNet, D = 64", 2, 1000, 1, 64, false},
                        {"KDA, D = 128", 1, 1000, 2, 128, true}};
  ScopedEnv segments("MHLA_DELTA_WALK_SEGMENTS", "1");
  for (const auto& c : cases) {
    INFO(c.what << " (B=" << c.b << " T=" << c.t << " H=" << c.h << ")");
    torch::manual_seed(5);
    FusedLeaves leaves(make_inputs(c.b, c.t, c.h, c.d, c.d, 1.0, c.per_key, true));
    const double scale = 1.0 / std::sqrt(static_cast<double>(c.d));
    segments.set("1");
    const auto whole = leaves.step(scale);
    for (const char* count : {"2", "3", "16"}) {
      INFO(count << " segments");
      segments.set(count);
      mhla_kernels::GatedDeltaArgs shape;
      shape.batch = static_cast<int>(c.b), shape.tokens = static_cast<int>(c.t);
      shape.heads = static_cast<int>(c.h), shape.head_dim = static_cast<int>(c.d);
      REQUIRE(mhla_kernels::gated_delta_walk_segments(shape) == std::atoi(count));
      const auto cut = leaves.step(scale);
      for (size_t i = 0; i < whole.size(); ++i) {
        INFO(kFusedResultNames[i]);
        CHECK(torch::equal(cut[i], whole[i]));
      }
    }
  }
#endif
}

TEST_CASE(
    "delta rule: the pipelined fused kernels captured in a CUDA graph replay eager's results on "
    "new inputs",
    "[attention][gpu]") {
  if (!torch::cuda::is_available()) {
    WARN("no CUDA device: skipped");
    return;
  }
#ifdef MHLA_WITH_CUDA_KERNELS
  // The walk stream joins the capture through the events that fork and join it; a replay on new
  // inputs must equal an eager forward+backward on them (the training step's graph, as
  // train.cuda_graph captures it, with the walks in segments).
  ScopedEnv segments("MHLA_DELTA_WALK_SEGMENTS", "3");
  for (const bool per_key : {false, true}) {
    INFO((per_key ? "KDA" : "gated DeltaNet"));
    torch::manual_seed(9);
    const auto first = make_inputs(1, 1000, 2, 64, 64, 1.0, per_key, true);
    const auto second = make_inputs(1, 1000, 2, 64, 64, 1.0, per_key, true);
    const double scale = 0.125;
    FusedLeaves leaves(first);
    auto side = c10::cuda::getStreamFromPool();
    torch::cuda::synchronize();
    at::cuda::CUDAGraph graph;
    std::vector<torch::Tensor> captured;
    {
      c10::cuda::CUDAStreamGuard on_side(side);
      leaves.step(scale);  // warm-up: the walk streams and their events exist before the capture
      side.synchronize();
      graph.capture_begin({0, 0}, cudaStreamCaptureModeThreadLocal);
      captured = leaves.step(scale);
      graph.capture_end();
    }
    leaves.assign(second);
    graph.replay();
    torch::cuda::synchronize();
    FusedLeaves eager(second);
    const auto expected = eager.step(scale);
    REQUIRE(captured.size() == expected.size());
    for (size_t i = 0; i < expected.size(); ++i) {
      INFO(kFusedResultNames[i]);
      CHECK(torch::equal(captured[i], expected[i]));
    }
  }
#endif
}

TEST_CASE("delta rule: the fused gated DeltaNet entry refuses what its kernels do not take",
          "[attention]") {
  auto in = make_inputs(1, 70, 2, 64, 64, 1.0, false, false);
  auto bf16 = [](const torch::Tensor& x) { return x.to(torch::kBFloat16); };
  // CPU tensors (and, without a GPU build, everything) go to the batched path instead.
  CHECK_FALSE(gated_delta_fused_takes(bf16(in.q), bf16(in.k), bf16(in.v), in.g));
  std::string message;
  try {
    gated_delta_fused(bf16(in.q), bf16(in.k), bf16(in.v), in.beta, in.g, {}, 0.125);
  } catch (const Error& e) {
    message = e.what();
  }
  INFO(message);
  CHECK(message.find("gated DeltaNet (fused kernels): needs CUDA tensors") != std::string::npos);
  CHECK(message.find("q [1, 70, 2, 64]") != std::string::npos);
  // Nor is a per-key gate (KDA) of the wrong width.
  auto kda = make_inputs(1, 70, 2, 64, 64, 1.0, true, false);
  CHECK_FALSE(
      gated_delta_fused_takes(bf16(kda.q), bf16(kda.k), bf16(kda.v), kda.g.narrow(3, 0, 32)));
}
