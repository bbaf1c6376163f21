// The causal block-linear kernels (kernels/mhla/causal_block_linear, the `cuda` backend of causal
// linear attention and MHLA) against the plain-LibTorch reference in float64 on the same GPU:
// outputs, dq, dk, dv and the learned mixing matrix's gradient, on small odd shapes (the
// compute-sanitizer target) and at the language-model head size with more blocks than the mixing
// matrix was trained for (the long-sequence policy). The op-test harness covers the rest of its
// shape list.
#include "attention/causal_linear.h"
#include "catch_compat.h"
#include "test_helpers.h"

#ifdef MHLA_WITH_CUDA_KERNELS
#include "attention/causal_block_linear_cuda.h"
#include "core/device.h"
#endif

using namespace mhla;

namespace {

struct CausalCase {
  int64_t batch, heads, tokens, head_dim, mixing_blocks;  // mixing_blocks 0: linear attention
};

#ifdef MHLA_WITH_CUDA_KERNELS
struct Grads {
  torch::Tensor out, dq, dk, dv, dm;
};

Grads run(const torch::Tensor& q0, const torch::Tensor& k0, const torch::Tensor& v0,
          const torch::Tensor& m0, const torch::Tensor& grad_out, bool kernel) {
  auto leaf = [](const torch::Tensor& t) { return t.detach().clone().requires_grad_(true); };
  auto q = leaf(q0), k = leaf(k0), v = leaf(v0);
  auto m = m0.defined() ? leaf(m0) : torch::Tensor();
  torch::Tensor out;
  if (kernel) {
    out = causal_block_linear_cuda(q, k, v, m);
  } else {
    out = m.defined() ? causal_mhla_reference(q, k, v, m)
                      : causal_linear_attention_reference(q, k, v);
  }
  (out.to(torch::kFloat64) * grad_out).sum().backward();
  return {out.detach(), q.grad(), k.grad(), v.grad(), m.defined() ? m.grad() : torch::Tensor()};
}

void check_case(const CausalCase& c) {
  INFO("B=" << c.batch << " H=" << c.heads << " T=" << c.tokens << " D=" << c.head_dim
            << " M=" << c.mixing_blocks);
  const auto cuda = torch::TensorOptions().device(torch::kCUDA);
  const std::vector<int64_t> dims = {c.batch, c.tokens, c.heads, c.head_dim};
  auto q = torch::randn(dims, cuda).to(torch::kBFloat16);
  auto k = torch::randn(dims, cuda).to(torch::kBFloat16);
  auto v = torch::randn(dims, cuda).to(torch::kBFloat16);
  auto grad_out = torch::randn(dims, cuda.dtype(torch::kFloat64));
  torch::Tensor m;
  if (c.mixing_blocks > 0) {
    m = torch::rand({c.mixing_blocks, c.mixing_blocks}, cuda).tril() + 1e-5;
  }
  auto got = run(q, k, v, m, grad_out, true);
  auto f64 = [](const torch::Tensor& t) { return t.defined() ? t.to(torch::kFloat64) : t; };
  auto expected = run(f64(q), f64(k), f64(v), f64(m), grad_out, false);
  CHECK(got.out.scalar_type() == torch::kBFloat16);
  CHECK(test::relative_error(got.out, expected.out) < 5e-3);
  CHECK(test::relative_error(got.dq, expected.dq) < 8e-3);
  CHECK(test::relative_error(got.dk, expected.dk) < 8e-3);
  CHECK(test::relative_error(got.dv, expected.dv) < 8e-3);
  if (m.defined()) {
    // A row's scale does not change the normalized output: compare what is left after removing
    // each row's own direction (its component is rounding noise on both sides).
    auto mf = f64(m);
    auto project = [&](const torch::Tensor& x) {
      auto y = f64(x);
      return y - (y * mf).sum(1, true) / (mf * mf).sum(1, true) * mf;
    };
    CHECK(got.dm.triu(1).abs().max().item<double>() == 0.0);  // the upper triangle gets nothing
    // With one block in use or M = 1 only the rows' own directions carry gradient: nothing left.
    auto e = project(expected.dm);
    if (e.norm().item<double>() > 1e-2 * expected.dm.norm().item<double>()) {
      CHECK(test::relative_error(project(got.dm), e) < 2e-2);
    }
  }
}
#endif

}  // namespace

TEST_CASE("attention: causal block-linear kernels on small odd shapes", "[attention][gpu]") {
#ifdef MHLA_WITH_CUDA_KERNELS
  if (!torch::cuda::is_available()) {
    WARN("no CUDA device: skipped");
    return;
  }
  torch::manual_seed(21);
  // One partial block; a partial last block past M; M = 1; linear attention; D = 32 / 64 / 128;
  // eleven blocks past M = 3 (the sliding row with a two-block window and the tail). Inside the
  // trained length the prefix mixing is the state-mix kernel's, past it the kernels' prefix
  // sweeps: with a compile-time window (M = 3, 15, 70 and 131 blocks; M = 16) and the generic one
  // (M = 5, whose trained pairs the binding adds).
  for (const CausalCase& c :
       {CausalCase{1, 2, 40, 32, 4}, CausalCase{2, 3, 150, 64, 2}, CausalCase{1, 1, 200, 128, 1},
        CausalCase{2, 2, 130, 32, 0}, CausalCase{1, 2, 900, 64, 3}, CausalCase{1, 1, 64 * 70, 32, 3},
        CausalCase{1, 1, 64 * 130 + 17, 32, 3}, CausalCase{1, 2, 64 * 131, 32, 16},
        CausalCase{1, 1, 64 * 129 + 5, 32, 5}}) {
    check_case(c);
  }
  // A mixing matrix left on the host is refused by name, not read through a host pointer.
  const auto cuda = torch::TensorOptions().device(torch::kCUDA).dtype(torch::kBFloat16);
  auto q = torch::randn({1, 64, 2, 32}, cuda);
  auto host_mixing = torch::rand({4, 4}).tril();
  CHECK(test::contains(test::error_of([&] { causal_block_linear_cuda(q, q, q, host_mixing); }),
                       "mhla (cuda, causal): the mixing matrix is on cpu but q is on cuda:0"));
#else
  WARN("built without the CUDA kernels: skipped");
#endif
}

TEST_CASE("attention: causal block-linear kernels at the language-model head size",
          "[attention][gpu]") {
#ifdef MHLA_WITH_CUDA_KERNELS
  if (!torch::cuda::is_available()) {
    WARN("no CUDA device: skipped");
    return;
  }
  torch::manual_seed(22);
  // GPT's shape (16 trained blocks = 1,024 tokens); 33 blocks with a partial one past the trained
  // 16 (the sliding last row); linear attention at the same size.
  for (const CausalCase& c : {CausalCase{2, 8, 1024, 128, 16}, CausalCase{1, 4, 2100, 128, 16},
                              CausalCase{1, 8, 2048, 128, 0}}) {
    check_case(c);
  }
#else
  WARN("built without the CUDA kernels: skipped");
#endif
}

TEST_CASE(
    "attention: causal block-linear kernels with the prefix mixing forced either way, packed "
    "states and M = 32 past its trained length",
    "[attention][gpu]") {
#ifdef MHLA_WITH_CUDA_KERNELS
  if (!torch::cuda::is_available()) {
    WARN("no CUDA device: skipped");
    return;
  }
  torch::manual_seed(24);
  // The GEMM mix past the trained length (the expanded policy's matrix and its gradient mapped
  // back), the sweeps inside it (a compile-time window over fewer blocks than M, and the generic
  // one), and the sweeps on packed state and dP sets (bf16 matrices, fp32 z), with linear
  // attention and lanes past the end of the state (D = 32: 528 pairs of elements, so the third
  // 256-thread CTA of a batch*head has 16 live lanes).
  const CausalCase gemm_cases[] = {{1, 2, 900, 64, 3}, {1, 2, 2100, 32, 16}};
  const CausalCase sweep_cases[] = {{2, 2, 500, 32, 16}, {1, 2, 200, 64, 3}, {1, 1, 640, 32, 5}};
  const CausalCase packed_cases[] = {{1, 2, 900, 64, 3},
                                     {1, 2, 64 * 131, 32, 16},
                                     {1, 4, 2100, 128, 16},
                                     {2, 2, 130, 32, 0},
                                     {1, 1, 64 * 129 + 5, 32, 5}};
  {
    test::ScopedEnv gemm("MHLA_CAUSAL_MIX_GEMM", "1");
    for (const CausalCase& c : gemm_cases) check_case(c);
  }
  {
    test::ScopedEnv sweep("MHLA_CAUSAL_MIX_GEMM", "0");
    for (const CausalCase& c : sweep_cases) check_case(c);
  }
  {
    test::ScopedEnv packed("MHLA_CAUSAL_PACKED_STATES", "1");
    for (const CausalCase& c : packed_cases) check_case(c);
  }
  // M = 32 past its trained length (the widest compile-time sweeps), fp32 and packed states.
  const CausalCase wide_case{1, 2, 64 * 40 + 9, 32, 32};
  check_case(wide_case);
  {
    test::ScopedEnv packed("MHLA_CAUSAL_PACKED_STATES", "1");
    check_case(wide_case);
  }
#else
  WARN("built without the CUDA kernels: skipped");
#endif
}

TEST_CASE(
    "attention: causal block-linear kernels under bf16 autocast (the training step's setting)",
    "[attention][gpu]") {
#ifdef MHLA_WITH_CUDA_KERNELS
  if (!torch::cuda::is_available()) {
    WARN("no CUDA device: skipped");
    return;
  }
  torch::manual_seed(23);
  // Inside the trained length the prefix mixing is a GEMM on fp32 states: autocast must not turn
  // it into bf16 (it did once: "expected scalar type Float but found BFloat16").
  const auto cuda = torch::TensorOptions().device(torch::kCUDA);
  auto q = torch::randn({2, 256, 4, 64}, cuda.dtype(torch::kBFloat16)).requires_grad_(true);
  auto k = torch::randn({2, 256, 4, 64}, cuda.dtype(torch::kBFloat16)).requires_grad_(true);
  auto v = torch::randn({2, 256, 4, 64}, cuda.dtype(torch::kBFloat16)).requires_grad_(true);
  auto m = (torch::rand({4, 4}, cuda).tril() + 1e-5).requires_grad_(true);
  torch::Tensor out;
  {
    AutocastScope autocast(torch::Device(torch::kCUDA), true);
    out = causal_block_linear_cuda(q, k, v, m);
  }
  out.to(torch::kFloat32).square().sum().backward();
  auto expected =
      causal_mhla_reference(q.detach().to(torch::kFloat64), k.detach().to(torch::kFloat64),
                            v.detach().to(torch::kFloat64), m.detach().to(torch::kFloat64));
  CHECK(out.scalar_type() == torch::kBFloat16);
  CHECK(test::relative_error(out, expected) < 5e-3);
  CHECK(m.grad().defined());
  CHECK(m.grad().isfinite().all().item<bool>());
#else
  WARN("built without the CUDA kernels: skipped");
#endif
}
