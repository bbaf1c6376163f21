// train.deterministic (core/determinism.h): the switch itself, and the MHLA CUDA kernels' mixing
// gradient summed in a fixed order, per kernel family.
#include <ATen/Context.h>

#include "attention/attention_type.h"
#ifdef MHLA_WITH_CUDA_KERNELS
#include "attention/block_linear_cuda.h"
#endif
#include "catch_compat.h"
#include "core/config.h"
#include "core/determinism.h"
#include "test_helpers.h"

using namespace mhla;

TEST_CASE("config: train.deterministic turns ordered sums and cuDNN's deterministic mode on",
          "[config]") {
  CHECK_FALSE(parse_config("", "t.yaml", {}).train.deterministic);
  CHECK(parse_config("", "t.yaml", {"train.deterministic=true"}).train.deterministic);
  CHECK(test::contains(
      test::error_of([] { parse_config("", "t.yaml", {"train.deterministic=sometimes"}); }),
      "train.deterministic"));

  auto& context = at::globalContext();
  const bool cudnn_before = context.deterministicCuDNN();
  const bool benchmark_before = context.benchmarkCuDNN();
  CHECK_FALSE(deterministic_sums());
  CHECK_NOTHROW(require_ordered_sums("an atomic kernel"));
  {
    DeterministicSumsScope on(true);
    CHECK(deterministic_sums());
    CHECK(context.deterministicCuDNN());
    CHECK_FALSE(context.benchmarkCuDNN());
    const auto message = test::error_of([] { require_ordered_sums("an atomic kernel"); });
    CHECK(test::contains(message, "train.deterministic = true: an atomic kernel"));
    CHECK(test::contains(message, "attention.backend = reference"));
    {
      DeterministicSumsScope nested(true);  // already on: leaving it keeps it on
    }
    CHECK(deterministic_sums());
  }
  CHECK_FALSE(deterministic_sums());
  CHECK(context.deterministicCuDNN() == cudnn_before);
  CHECK(context.benchmarkCuDNN() == benchmark_before);
}

namespace {

struct Gradients {
  torch::Tensor out, dq, dk, dv, dm;
};

Gradients run_op(const OpFn& fn, const torch::Tensor& q, const torch::Tensor& k,
                 const torch::Tensor& v, const torch::Tensor& mixing, int64_t blocks,
                 const torch::Tensor& grad_out, bool causal = false) {
  auto qg = q.clone().requires_grad_(true), kg = k.clone().requires_grad_(true);
  auto vg = v.clone().requires_grad_(true);
  torch::Tensor mg;  // undefined: linear attention
  OpArgs args;
  args.causal = causal;
  if (mixing.defined()) {
    mg = mixing.clone().requires_grad_(true);
    args.blocks = blocks;
    args.mixing = mg;
  }
  auto out = fn(qg, kg, vg, args);
  out.backward(grad_out);
  return {out.detach(), qg.grad(), kg.grad(), vg.grad(),
          mg.defined() ? mg.grad() : torch::Tensor()};
}

struct Inputs {
  torch::Tensor q, k, v, grad_out;
};

// Random [B, N, H, D] q, k, v and output gradient on the GPU.
Inputs random_inputs(int64_t b, int64_t n, int64_t h, int64_t d, torch::ScalarType dtype) {
  auto options = torch::TensorOptions().device(torch::kCUDA).dtype(dtype);
  return {torch::randn({b, n, h, d}, options), torch::randn({b, n, h, d}, options),
          torch::randn({b, n, h, d}, options), torch::randn({b, n, h, d}, options)};
}

// Two deterministic runs give the same bits; against the atomic run, the tensors whose sums
// did not change are equal and the others agree to rounding (`summed_states`: blocks longer than
// one 256-token chunk, whose states and dS' the chunks' parts now make in a fixed order, so the
// output and every gradient may differ in last bits; the 1e-3 bound is far below the error of a
// missing or doubled part).
void check_deterministic(const Gradients& first, const Gradients& second, const Gradients& atomic,
                         bool summed_states) {
  CHECK(torch::equal(first.out, second.out));
  CHECK(torch::equal(first.dq, second.dq));
  CHECK(torch::equal(first.dk, second.dk));
  CHECK(torch::equal(first.dv, second.dv));
  if (first.dm.defined()) {
    CHECK(torch::equal(first.dm, second.dm));
    CHECK(test::relative_error(first.dm, atomic.dm) < (summed_states ? 1e-3 : 1e-5));
  }
  if (summed_states) {
    CHECK(test::relative_error(first.out, atomic.out) < 1e-3);
    CHECK(test::relative_error(first.dq, atomic.dq) < 1e-3);
    CHECK(test::relative_error(first.dk, atomic.dk) < 1e-3);
    CHECK(test::relative_error(first.dv, atomic.dv) < 1e-3);
  } else {  // only the mixing gradient's summation changed
    CHECK(torch::equal(first.out, atomic.out));
    CHECK(torch::equal(first.dq, atomic.dq));
    CHECK(torch::equal(first.dk, atomic.dk));
    CHECK(torch::equal(first.dv, atomic.dv));
  }
}

}  // namespace

// Each shape reaches one family: the resident kernels' scores-form backward (D = 32), their
// warpgroup kernels (N = 256 in 16 blocks, D = 64: DeiT-T/2 and DiT-S/2), the fragment passes
// with the packed mix backward (bf16, N = 1,024: DiT at 64 x 64) and the fp32-state mix backward
// (fp16 inputs); blocks of 512 tokens (two chunks per block state) on the fragment passes (bf16,
// D = 64) and on the general kernels (D = 128; fp32 inputs with a partial chunk); 32 and 64
// blocks, whose mixing gradient comes from the pair-products kernel (its parts summed in order:
// register fragments up to 32 rows, shared-memory tiles above). In
// deterministic mode two runs give the same bits, and the ordered sums agree with the atomic
// ones to rounding.
TEST_CASE(
    "attention: with train.deterministic MHLA's CUDA gradients are the same bits on every run",
    "[attention][gpu]") {
  if (!torch::cuda::is_available()) {
    WARN("no CUDA device: skipped");
    return;
  }
  const auto& type = attention_registry().get("mhla");
  const auto& fn = type.backends.at("cuda");
  struct Case {
    int64_t b, n, h, d, blocks;
    torch::ScalarType dtype;
  };
  const std::vector<Case> cases = {
      {8, 64, 2, 32, 4, torch::kBFloat16},    {8, 256, 6, 64, 16, torch::kBFloat16},
      {4, 1024, 6, 64, 16, torch::kBFloat16}, {4, 1024, 6, 64, 16, torch::kFloat16},
      {2, 1024, 2, 64, 4, torch::kBFloat16},  {2, 1024, 2, 64, 2, torch::kBFloat16},
      {2, 1024, 2, 128, 2, torch::kBFloat16}, {2, 600, 2, 64, 2, torch::kFloat32},
      {2, 1024, 2, 64, 32, torch::kBFloat16}, {2, 1024, 2, 64, 64, torch::kBFloat16}};
  torch::manual_seed(41);
  for (const auto& c : cases) {
    INFO("B " << c.b << " N " << c.n << " H " << c.h << " D " << c.d << " M " << c.blocks << " "
              << c10::toString(c.dtype));
    const auto [q, k, v, grad_out] = random_inputs(c.b, c.n, c.h, c.d, c.dtype);
    auto mixing =
        torch::eye(c.blocks, torch::TensorOptions().device(torch::kCUDA)) * 0.5 +
        torch::rand({c.blocks, c.blocks}, torch::TensorOptions().device(torch::kCUDA)) * 0.1;
    const Gradients atomic = run_op(fn, q, k, v, mixing, c.blocks, grad_out);
    DeterministicSumsScope deterministic(true);
    const Gradients first = run_op(fn, q, k, v, mixing, c.blocks, grad_out);
    const Gradients second = run_op(fn, q, k, v, mixing, c.blocks, grad_out);
    check_deterministic(first, second, atomic, c.n / c.blocks > 256);
  }
}

// Linear attention's state is one block of N tokens: past N = 256 its 256-token chunks store
// parts that are summed in chunk order. The fragment passes (D = 64; 4 and 64 chunks) and the
// general kernels (D = 128; fp32 inputs with a partial last chunk).
TEST_CASE("attention: with train.deterministic linear attention's CUDA kernels give the same bits",
          "[attention][gpu]") {
  if (!torch::cuda::is_available()) {
    WARN("no CUDA device: skipped");
    return;
  }
  const auto& fn = attention_registry().get("linear").backends.at("cuda");
  struct Case {
    int64_t b, n, h, d;
    torch::ScalarType dtype;
  };
  const std::vector<Case> cases = {{2, 1024, 2, 64, torch::kBFloat16},
                                   {1, 16384, 2, 64, torch::kBFloat16},
                                   {2, 700, 2, 128, torch::kBFloat16},
                                   {2, 600, 2, 32, torch::kFloat32},
                                   {4, 256, 2, 64, torch::kBFloat16}};
  torch::manual_seed(43);
  for (const auto& c : cases) {
    INFO("B " << c.b << " N " << c.n << " H " << c.h << " D " << c.d << " "
              << c10::toString(c.dtype));
    const auto [q, k, v, grad_out] = random_inputs(c.b, c.n, c.h, c.d, c.dtype);
    const Gradients atomic = run_op(fn, q, k, v, {}, 1, grad_out);
    DeterministicSumsScope deterministic(true);
    const Gradients first = run_op(fn, q, k, v, {}, 1, grad_out);
    const Gradients second = run_op(fn, q, k, v, {}, 1, grad_out);
    check_deterministic(first, second, atomic, c.n > 256);
  }
}

// Causal MHLA (GPT): inside the trained length the query pass stores its diagonal dm_ii parts
// and the fused mix backward (up to 32 blocks) or the pair-products kernel (40 blocks here) its
// pair-product parts, all summed in order; the general query
// kernel (fp32 inputs) and the lean one (16-bit). Causal linear attention has no atomics.
TEST_CASE(
    "attention: with train.deterministic causal MHLA's and linear attention's CUDA gradients "
    "are the same bits on every run",
    "[attention][gpu]") {
  if (!torch::cuda::is_available()) {
    WARN("no CUDA device: skipped");
    return;
  }
  struct Case {
    const char* op;
    int64_t b, n, h, d, blocks;
    torch::ScalarType dtype;
  };
  const std::vector<Case> cases = {{"mhla", 2, 256, 2, 64, 4, torch::kBFloat16},
                                   {"mhla", 2, 512, 3, 64, 8, torch::kBFloat16},
                                   {"mhla", 2, 256, 2, 32, 4, torch::kFloat16},
                                   {"mhla", 1, 320, 2, 64, 5, torch::kFloat32},
                                   {"mhla", 1, 2560, 2, 64, 40, torch::kBFloat16},
                                   {"linear", 2, 512, 2, 64, 1, torch::kBFloat16}};
  torch::manual_seed(47);
  for (const auto& c : cases) {
    INFO(c.op << " B " << c.b << " T " << c.n << " H " << c.h << " D " << c.d << " M " << c.blocks
              << " " << c10::toString(c.dtype));
    const auto& type = attention_registry().get(c.op);
    const auto& fn = type.backends.at("cuda");
    const auto [q, k, v, grad_out] = random_inputs(c.b, c.n, c.h, c.d, c.dtype);
    torch::Tensor mixing;
    if (std::string(c.op) == "mhla") {
      mixing = type.make_args({c.b, c.n, c.h, c.d, c.blocks, true},
                              torch::TensorOptions().device(torch::kCUDA))
                   .mixing.detach();
    }
    const Gradients atomic = run_op(fn, q, k, v, mixing, c.blocks, grad_out, true);
    DeterministicSumsScope deterministic(true);
    const Gradients first = run_op(fn, q, k, v, mixing, c.blocks, grad_out, true);
    const Gradients second = run_op(fn, q, k, v, mixing, c.blocks, grad_out, true);
    check_deterministic(first, second, atomic, false);
  }
}

// Softmax attention: with the switch, 16-bit CUDA inputs go through FlashAttention with its
// ordered backward instead of SDPA's choice (whose cuDNN and flash backwards add dq in arrival
// order). Two runs give the same bits, and both agree with SDPA to bf16 rounding.
TEST_CASE("attention: with train.deterministic softmax attention's gradients are the same bits",
          "[attention][gpu]") {
  if (!torch::cuda::is_available()) {
    WARN("no CUDA device: skipped");
    return;
  }
  const auto& fn = attention_registry().get("softmax").backends.at("reference");
  struct Case {
    int64_t b, n, h, d;
    bool causal;
    torch::ScalarType dtype;
  };
  const std::vector<Case> cases = {{8, 1024, 6, 64, false, torch::kBFloat16},
                                   {4, 300, 2, 128, true, torch::kBFloat16},
                                   {2, 256, 3, 32, false, torch::kFloat16}};
  torch::manual_seed(53);
  for (const auto& c : cases) {
    INFO("B " << c.b << " N " << c.n << " H " << c.h << " D " << c.d << " causal " << c.causal
              << " " << c10::toString(c.dtype));
    const auto [q, k, v, grad_out] = random_inputs(c.b, c.n, c.h, c.d, c.dtype);
    const Gradients sdpa = run_op(fn, q, k, v, {}, 1, grad_out, c.causal);
    DeterministicSumsScope deterministic(true);
    const Gradients first = run_op(fn, q, k, v, {}, 1, grad_out, c.causal);
    const Gradients second = run_op(fn, q, k, v, {}, 1, grad_out, c.causal);
    CHECK(torch::equal(first.out, second.out));
    CHECK(torch::equal(first.dq, second.dq));
    CHECK(torch::equal(first.dk, second.dk));
    CHECK(torch::equal(first.dv, second.dv));
    CHECK(test::relative_error(first.out, sdpa.out) < 1e-2);
    CHECK(test::relative_error(first.dq, sdpa.dq) < 1e-2);
    CHECK(test::relative_error(first.dk, sdpa.dk) < 1e-2);
    CHECK(test::relative_error(first.dv, sdpa.dv) < 1e-2);
    // ATen's deterministic-algorithms flag is set around the backward only.
    CHECK_FALSE(at::globalContext().deterministicAlgorithms());
  }
}

TEST_CASE("attention: with train.deterministic the kernels that add with atomics refuse, by name",
          "[attention][gpu]") {
  if (!torch::cuda::is_available()) {
    WARN("no CUDA device: skipped");
    return;
  }
  auto options = torch::TensorOptions().device(torch::kCUDA).dtype(torch::kBFloat16);
  DeterministicSumsScope deterministic(true);
  const auto& mhla = attention_registry().get("mhla").backends.at("cuda");
  // Causal MHLA past its trained length (8 blocks of 64 tokens, 4 trained): the sweeps add the
  // sliding row's mixing gradient with atomics.
  auto qc = torch::randn({1, 512, 2, 64}, options).requires_grad_(true);
  const OpArgs causal = attention_registry().get("mhla").make_args(
      {1, 256, 2, 64, 4, true}, torch::TensorOptions().device(torch::kCUDA));
  auto message = test::error_of([&] { mhla(qc, qc, qc, causal).sum().backward(); });
  CHECK(test::contains(message,
                       "the causal MHLA backward's mixing gradient at 8 blocks of 64 tokens "
                       "(trained on 4"));
#ifdef MHLA_WITH_CUDA_KERNELS
  // The cluster family (only on request: MHLA_BIDIRECTIONAL_KERNEL=cluster).
  auto qx = torch::randn({2, 256, 2, 64}, options).requires_grad_(true);
  auto mixing = torch::eye(4, torch::TensorOptions().device(torch::kCUDA)).requires_grad_(true);
  message = test::error_of(
      [&] { block_linear_by_named_family("cluster", qx, qx, qx, mixing, 4).sum().backward(); });
  CHECK(test::contains(message, "the cluster-family MHLA backward"));
#endif
}
