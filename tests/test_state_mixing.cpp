// The GPU helpers that mix fp32 block states for the MHLA bindings (src/attention/state_mixing):
// the state-mix kernel against a float64 matrix product (dense, strictly lower and strictly upper
// weights; block counts that fill no, one and several 8- and 16-block groups; cuBLAS past 128
// blocks),
// and the pair-products kernel (tensor cores on bf16 high and low parts of the fp32 inputs)
// against a float64 contraction at 1e-4 (bf16-rounded inputs alone err by about 2^-9 per term),
// over row counts that pad to 16 (3, 40), fill one 16 x 16 tile (16), give every warp two tiles
// (64), and element counts that end inside an item (D = 32: 1,056 floats per state); and the fused
// backward of the mix (d states and d mixing in one pass) against float64, with more items than
// its persistent CTAs.
#include <cmath>

#include "catch_compat.h"
#include "core/determinism.h"
#include "test_helpers.h"

#ifdef MHLA_WITH_CUDA_KERNELS
#include "attention/state_mixing.h"
#include "core/error.h"
#endif

using namespace mhla;

TEST_CASE("attention: block state mix against float64", "[attention][gpu]") {
#ifdef MHLA_WITH_CUDA_KERNELS
  if (!torch::cuda::is_available()) {
    WARN("no CUDA device: skipped");
    return;
  }
  torch::manual_seed(32);
  using mhla_kernels::MixPattern;
  const auto cuda = torch::TensorOptions().device(torch::kCUDA).dtype(torch::kFloat32);
  struct Case {
    int64_t batch_heads, blocks, elements;
  };
  for (const Case& c :
       {Case{3, 1, 1056}, Case{2, 3, 4160}, Case{5, 16, 4160}, Case{2, 33, 1056},
        Case{1, 64, 16512}, Case{2, 70, 1056}, Case{1, 128, 1056}, Case{1, 130, 1056}}) {
    for (const MixPattern pattern : {MixPattern::dense, MixPattern::lower, MixPattern::upper}) {
      INFO("BH=" << c.batch_heads << " blocks=" << c.blocks << " E=" << c.elements
                 << " pattern=" << static_cast<int>(pattern));
      auto states = torch::randn({c.batch_heads, c.blocks, c.elements}, cuda);
      auto weights = torch::rand({c.blocks, c.blocks}, cuda);
      if (pattern == MixPattern::lower) weights = weights.tril(-1);
      if (pattern == MixPattern::upper) weights = weights.triu(1);
      auto got = mix_block_states(weights, states, pattern);
      auto expected = torch::matmul(weights.to(torch::kFloat64), states.to(torch::kFloat64));
      REQUIRE(got.sizes() == expected.sizes());
      if (c.blocks == 1 && pattern != MixPattern::dense) {
        CHECK(got.abs().max().item<double>() == 0.0);  // the only weight is on the diagonal
      } else {
        CHECK(test::relative_error(got, expected) < 1e-5);
      }
    }
  }
  // A transposed (non-contiguous) weight view is read as the matrix it shows.
  auto states = torch::randn({4, 16, 4160}, cuda);
  auto weights = torch::rand({16, 16}, cuda);
  auto expected = torch::matmul(weights.t().to(torch::kFloat64), states.to(torch::kFloat64));
  CHECK(test::relative_error(mix_block_states(weights.t(), states), expected) < 1e-5);
  CHECK(test::contains(test::error_of([&] { mix_block_states(weights.narrow(0, 0, 8), states); }),
                       "block state mix: states must be fp32 [BH, blocks, E]"));
#else
  WARN("built without the CUDA kernels: skipped");
#endif
}

TEST_CASE("attention: block state mix into a packed set of causal prefixes", "[attention][gpu]") {
#ifdef MHLA_WITH_CUDA_KERNELS
  if (!torch::cuda::is_available()) {
    WARN("no CUDA device: skipped");
    return;
  }
  torch::manual_seed(33);
  using mhla_kernels::MixPattern;
  const auto cuda = torch::TensorOptions().device(torch::kCUDA).dtype(torch::kFloat32);
  // Per row: the D x D matrix part in bf16 (the fp32 mix rounded once), then z in fp32 as is.
  for (const int64_t d : {32, 64, 128}) {
    INFO("D=" << d);
    const int64_t blocks = 20, elements = d * d + d;
    auto states = torch::randn({3, blocks, elements}, cuda);
    auto weights = torch::rand({blocks, blocks}, cuda).tril(-1);
    auto full = mix_block_states(weights, states, MixPattern::lower);
    auto packed = mix_block_states(weights, states, MixPattern::lower, d * d);
    REQUIRE(packed.sizes() == torch::IntArrayRef({3, blocks, d * d / 2 + d}));
    auto matrix = packed.narrow(2, 0, d * d / 2).contiguous().view(torch::kBFloat16);
    CHECK(torch::equal(matrix, full.narrow(2, 0, d * d).to(torch::kBFloat16)));
    CHECK(torch::equal(packed.narrow(2, d * d / 2, d), full.narrow(2, d * d, d)));
  }
  auto states = torch::randn({1, 4, 1056}, cuda);
  auto weights = torch::rand({4, 4}, cuda).tril(-1);
  CHECK(test::contains(
      test::error_of([&] { mix_block_states(weights, states, MixPattern::lower, 1020); }),
      "block state mix: a packed output needs a matrix part of 0 to 1056 elements, a multiple of "
      "8"));
#else
  WARN("built without the CUDA kernels: skipped");
#endif
}

TEST_CASE("attention: block pair products (mixing gradient) against float64", "[attention][gpu]") {
#ifdef MHLA_WITH_CUDA_KERNELS
  if (!torch::cuda::is_available()) {
    WARN("no CUDA device: skipped");
    return;
  }
  torch::manual_seed(31);
  const auto cuda = torch::TensorOptions().device(torch::kCUDA).dtype(torch::kFloat32);
  struct Case {
    int64_t batch_heads, blocks, rows, elements;
  };
  for (const Case& c : {Case{3, 5, 3, 1056}, Case{7, 16, 16, 4160}, Case{2, 64, 64, 1056},
                        Case{5, 33, 16, 16512}, Case{1, 1, 1, 4}, Case{3, 48, 40, 1056}}) {
    INFO("BH=" << c.batch_heads << " blocks=" << c.blocks << " rows=" << c.rows
               << " E=" << c.elements);
    auto x = torch::randn({c.batch_heads, c.blocks, c.elements}, cuda);
    auto y = torch::randn({c.batch_heads, c.blocks, c.elements}, cuda);
    auto got = block_pair_products(x, y, c.rows);
    auto xd = x.narrow(1, 0, c.rows).to(torch::kFloat64);
    auto yd = y.narrow(1, 0, c.rows).to(torch::kFloat64);
    auto expected = torch::einsum("bie,bje->ij", {xd, yd});
    REQUIRE(got.sizes() == expected.sizes());
    CHECK(test::relative_error(got, expected) < 1e-4);
  }
  // Packed sets (the causal sweeps' states and prefix gradients): a bf16 matrix part, then fp32.
  for (const Case& c : {Case{5, 33, 16, 16512}, Case{3, 20, 20, 1056}, Case{2, 9, 4, 4160}}) {
    const int64_t matrix = c.elements == 16512 ? 16384 : c.elements == 4160 ? 4096 : 1024;
    INFO("packed: BH=" << c.batch_heads << " blocks=" << c.blocks << " rows=" << c.rows
                       << " E=" << c.elements << " matrix=" << matrix);
    auto x = torch::randn({c.batch_heads, c.blocks, c.elements}, cuda);
    auto y = torch::randn({c.batch_heads, c.blocks, c.elements}, cuda);
    auto pack = [&](const torch::Tensor& t) {
      auto bits = t.narrow(2, 0, matrix).to(torch::kBFloat16).contiguous().view(torch::kFloat32);
      return torch::cat({bits, t.narrow(2, matrix, c.elements - matrix)}, 2).contiguous();
    };
    auto unpacked = [&](const torch::Tensor& t) {  // what the packed set holds, in float64
      return torch::cat({t.narrow(2, 0, matrix).to(torch::kBFloat16).to(torch::kFloat64),
                         t.narrow(2, matrix, c.elements - matrix).to(torch::kFloat64)},
                        2)
          .narrow(1, 0, c.rows);
    };
    auto got = block_pair_products(pack(x), pack(y), c.rows, matrix);
    auto expected = torch::einsum("bie,bje->ij", {unpacked(x), unpacked(y)});
    REQUIRE(got.sizes() == expected.sizes());
    CHECK(test::relative_error(got, expected) < 1e-4);
  }
  // train.deterministic: each CTA's (or warp's) part summed in a fixed order, the same bits on
  // every run, equal to the atomic sums up to their order (both kernels: fragments up to 32
  // rows, shared-memory tiles above).
  for (const Case& c : {Case{7, 16, 16, 4160}, Case{9, 20, 20, 1056}, Case{2, 64, 64, 1056},
                        Case{3, 48, 40, 4160}}) {
    INFO("deterministic: BH=" << c.batch_heads << " blocks=" << c.blocks << " rows=" << c.rows
                              << " E=" << c.elements);
    auto x = torch::randn({c.batch_heads, c.blocks, c.elements}, cuda);
    auto y = torch::randn({c.batch_heads, c.blocks, c.elements}, cuda);
    const auto atomic = block_pair_products(x, y, c.rows);
    const DeterministicSumsScope ordered(true);
    const auto first = block_pair_products(x, y, c.rows);
    const auto second = block_pair_products(x, y, c.rows);
    CHECK(torch::equal(first, second));
    CHECK(test::relative_error(first, atomic) < 1e-5);
    auto expected = torch::einsum("bie,bje->ij", {x.narrow(1, 0, c.rows).to(torch::kFloat64),
                                                  y.narrow(1, 0, c.rows).to(torch::kFloat64)});
    CHECK(test::relative_error(first, expected) < 1e-4);
  }
  // Bad input is refused by name, not read out of bounds.
  auto x = torch::randn({2, 4, 8}, cuda);
  CHECK(test::contains(test::error_of([&] { block_pair_products(x, x.to(torch::kFloat64), 2); }),
                       "block pair products: x and y must be contiguous fp32"));
  CHECK(test::contains(test::error_of([&] { block_pair_products(x, x, 5); }),
                       "block pair products: 5 rows of [BH, nb, E] = [2, 4, 8]"));
  CHECK(test::contains(test::error_of([&] { block_pair_products(x, x, 2, 4); }),
                       "a packed matrix part of 4 elements"));
#else
  WARN("built without the CUDA kernels: skipped");
#endif
}

TEST_CASE("attention: fused block mix backward against float64", "[attention][gpu]") {
#ifdef MHLA_WITH_CUDA_KERNELS
  if (!torch::cuda::is_available()) {
    WARN("no CUDA device: skipped");
    return;
  }
  torch::manual_seed(33);
  const auto cuda = torch::TensorOptions().device(torch::kCUDA).dtype(torch::kFloat32);
  struct Case {
    int64_t batch_heads, blocks, elements;
  };
  // 16 blocks at D = 64 (4,160 floats: the last 256-element item is partial); 400 batch*heads give
  // 6,800 items, more than the resident CTAs, so each CTA walks several with both stages; 9, 4 and
  // 1 blocks leave padding rows; D = 32 and D = 128 state sizes; a state shorter than one item.
  // 17 to 32 blocks take the 32-row kernel (64-element items: 128 x 258 items at the causal
  // T = 2,048 shape), with strictly lower weights as the causal prefix has.
  for (const Case& c : {Case{3, 16, 4160}, Case{400, 16, 4160}, Case{5, 9, 1056}, Case{7, 4, 16512},
                        Case{2, 1, 20}, Case{33, 16, 1056}, Case{128, 32, 16512}, Case{3, 17, 4160},
                        Case{9, 24, 1056}, Case{2, 32, 20}}) {
    INFO("BH=" << c.batch_heads << " blocks=" << c.blocks << " E=" << c.elements);
    auto grad_mixed = torch::randn({c.batch_heads, c.blocks, c.elements}, cuda);
    auto states = torch::randn({c.batch_heads, c.blocks, c.elements}, cuda);
    auto mixing = torch::rand({c.blocks, c.blocks}, cuda);
    if (c.blocks > 16) mixing = mixing.tril(-1);
    auto [grad_states, grad_mixing] = mix_block_states_backward(mixing, grad_mixed, states);
    auto xd = grad_mixed.to(torch::kFloat64), yd = states.to(torch::kFloat64);
    auto expected_states = torch::einsum("ij,bie->bje", {mixing.to(torch::kFloat64), xd});
    auto expected_mixing = torch::einsum("bie,bje->ij", {xd, yd});
    REQUIRE(grad_states.sizes() == expected_states.sizes());
    REQUIRE(grad_mixing.sizes() == expected_mixing.sizes());
    CHECK(test::relative_error(grad_states, expected_states) < 1e-5);
    CHECK(test::relative_error(grad_mixing, expected_mixing) < 1e-5);
  }
  // d states as a packed set (the bidirectional MHLA binding's bf16 path): the matrix part is
  // the fp32 result rounded to bf16 (round to nearest: within half a bf16 ulp, at most 2^-8 of
  // the value; plus the fp32 sum's own error), the rest fp32; dm is unchanged. 4,160 = 64 x 64 + 64
  // and 1,056 = 32 x 32 + 32 floats.
  for (const Case& c :
       {Case{3, 16, 4160}, Case{400, 16, 4160}, Case{33, 16, 1056}, Case{9, 24, 1056}}) {
    const int64_t matrix = c.elements == 4160 ? 4096 : 1024;
    INFO("packed: BH=" << c.batch_heads << " blocks=" << c.blocks << " E=" << c.elements);
    auto grad_mixed = torch::randn({c.batch_heads, c.blocks, c.elements}, cuda);
    auto states = torch::randn({c.batch_heads, c.blocks, c.elements}, cuda);
    auto mixing = torch::rand({c.blocks, c.blocks}, cuda);
    if (c.blocks > 16) mixing = mixing.tril(-1);
    auto [packed, grad_mixing] = mix_block_states_backward(mixing, grad_mixed, states, matrix);
    REQUIRE(packed.sizes() ==
            torch::IntArrayRef({c.batch_heads, c.blocks, matrix / 2 + c.elements - matrix}));
    auto expected =
        torch::einsum("ij,bie->bje", {mixing.to(torch::kFloat64), grad_mixed.to(torch::kFloat64)});
    auto matrix_part =
        packed.narrow(2, 0, matrix / 2).contiguous().view(torch::kBFloat16).to(torch::kFloat64);
    auto rest = packed.narrow(2, matrix / 2, c.elements - matrix);
    auto expected_matrix = expected.narrow(2, 0, matrix);
    CHECK(((matrix_part - expected_matrix).abs() <=
           expected_matrix.abs() * std::ldexp(1.0, -8) + 1e-6 * expected_matrix.abs().max())
              .all()
              .item<bool>());
    CHECK(test::relative_error(rest, expected.narrow(2, matrix, c.elements - matrix)) < 1e-5);
    CHECK(test::relative_error(grad_mixing,
                               torch::einsum("bie,bje->ij", {grad_mixed.to(torch::kFloat64),
                                                             states.to(torch::kFloat64)})) < 1e-5);
  }
  auto x = torch::randn({2, 4, 8}, cuda);
  auto m = torch::rand({4, 4}, cuda);
  CHECK(
      test::contains(test::error_of([&] { mix_block_states_backward(m, x, x, 4); }),
                     "a packed d states needs a matrix part of 0 to 8 elements, a multiple of 8"));
  CHECK(test::contains(
      test::error_of([&] { mix_block_states_backward(m, x.to(torch::kFloat64), x); }),
      "block mix backward: d mixed and states must be contiguous fp32"));
  CHECK(test::contains(test::error_of([&] { mix_block_states_backward(m.narrow(0, 0, 2), x, x); }),
                       "block mix backward"));
#else
  WARN("built without the CUDA kernels: skipped");
#endif
}

#ifdef MHLA_WITH_CUDA_KERNELS
namespace {

// A packed set of fp32 states [BH, nb, E]: the first `matrix` elements of each row as bf16 (two
// per float), the rest fp32; and the fp32 values such a set holds.
torch::Tensor packed_set(const torch::Tensor& x, int64_t matrix) {
  const int64_t e = x.size(2);
  return torch::cat({x.narrow(2, 0, matrix).to(torch::kBFloat16).contiguous().view(torch::kFloat32),
                     x.narrow(2, matrix, e - matrix)},
                    2)
      .contiguous();
}
torch::Tensor held_by_set(const torch::Tensor& x, int64_t matrix) {
  const int64_t e = x.size(2);
  return torch::cat({x.narrow(2, 0, matrix).to(torch::kBFloat16).to(torch::kFloat32),
                     x.narrow(2, matrix, e - matrix)},
                    2);
}

// A packed result against its float64 reference [BH, nb, E]: the matrix part within a bf16 ulp
// of the value (2^-8 relative) plus `slack` (float64, E's shape: the error of the sum before
// rounding), the rest fp32 at 1e-5.
void check_packed_result(const torch::Tensor& packed, const torch::Tensor& expected, int64_t matrix,
                         const torch::Tensor& slack) {
  const int64_t e = expected.size(2);
  REQUIRE(packed.sizes() ==
          torch::IntArrayRef({expected.size(0), expected.size(1), matrix / 2 + e - matrix}));
  auto got_matrix =
      packed.narrow(2, 0, matrix / 2).contiguous().view(torch::kBFloat16).to(torch::kFloat64);
  auto expected_matrix = expected.narrow(2, 0, matrix);
  CHECK(((got_matrix - expected_matrix).abs() <=
         expected_matrix.abs() * std::ldexp(1.0, -8) + slack.narrow(2, 0, matrix))
            .all()
            .item<bool>());
  CHECK(test::relative_error(packed.narrow(2, matrix / 2, e - matrix),
                             expected.narrow(2, matrix, e - matrix)) < 1e-5);
}

}  // namespace
#endif

// The bidirectional MHLA binding at one chunk per block keeps S and dS' as packed sets (bf16
// matrices, fp32 z): the mix reads packed S and writes packed S' (up to 16 blocks: the matrix
// part on tensor cores, as the backward; past 16 blocks 16-byte loads of eight bf16 on CUDA
// cores); the mix backward reads packed dS' and S (up to 16 blocks: the matrix part on tensor
// cores, with more items than CTAs, and the fp32 rest; past 16 blocks the mix plus pair products).
// Each is compared in float64 with the values the sets hold, so the new errors are the outputs'
// rounding to bf16 and, for dm, the tensor cores' fp32 accumulation (1e-4 instead of 1e-5).
TEST_CASE("attention: block state mix and its backward on packed block states",
          "[attention][gpu]") {
#ifdef MHLA_WITH_CUDA_KERNELS
  if (!torch::cuda::is_available()) {
    WARN("no CUDA device: skipped");
    return;
  }
  torch::manual_seed(34);
  using mhla_kernels::MixPattern;
  const auto cuda = torch::TensorOptions().device(torch::kCUDA).dtype(torch::kFloat32);
  struct Case {
    int64_t batch_heads, blocks, d;
  };
  for (const Case& c : {Case{5, 16, 64}, Case{400, 16, 64}, Case{3, 5, 64}, Case{9, 24, 32},
                        Case{33, 16, 32}, Case{4, 40, 32}, Case{2, 1, 64}}) {
    const int64_t matrix = c.d * c.d, elements = matrix + c.d;
    INFO("BH=" << c.batch_heads << " blocks=" << c.blocks << " D=" << c.d);
    auto states = torch::randn({c.batch_heads, c.blocks, elements}, cuda);
    auto grad_mixed = torch::randn({c.batch_heads, c.blocks, elements}, cuda);
    auto mixing = torch::rand({c.blocks, c.blocks}, cuda);
    auto held_states = held_by_set(states, matrix).to(torch::kFloat64);
    auto held_grad = held_by_set(grad_mixed, matrix).to(torch::kFloat64);
    // The mix: packed in, packed out. Up to 16 blocks the matrix part runs on tensor cores with m
    // as bf16 high and low parts (packed_mix.cuh): slack 2^-15 sum_j |m_ij| |S_j|, as for the
    // backward below; past 16 blocks fp32 sums on CUDA cores, well inside it. The rest (z) is
    // fp32 either way (relative error 1e-5 in check_packed_result).
    auto mixed =
        mix_block_states(mixing, packed_set(states, matrix), MixPattern::dense, matrix, true);
    auto expected_mixed = torch::matmul(mixing.to(torch::kFloat64), held_states);
    check_packed_result(
        mixed, expected_mixed, matrix,
        torch::matmul(mixing.abs().to(torch::kFloat64), held_states.abs()) * std::ldexp(1.0, -15));
    // The backward: packed dS' and S in, packed dS out, dm fp32. Up to 16 blocks dS runs on
    // tensor cores with m as bf16 high and low parts, which leave up to 2^-16 |m_ij| out of each
    // term: slack 2^-15 sum_i |m_ij| |dS'_i|.
    auto [grad_states, grad_mixing] = mix_block_states_backward(
        mixing, packed_set(grad_mixed, matrix), packed_set(states, matrix), matrix, true);
    check_packed_result(
        grad_states, torch::einsum("ij,bie->bje", {mixing.to(torch::kFloat64), held_grad}), matrix,
        torch::einsum("ij,bie->bje", {mixing.abs().to(torch::kFloat64), held_grad.abs()}) *
            std::ldexp(1.0, -15));
    CHECK(test::relative_error(grad_mixing,
                               torch::einsum("bie,bje->ij", {held_grad, held_states})) < 1e-4);
  }
  // The lower pattern (what the causal binding's prefix mix promises) reads packed input too.
  auto states = torch::randn({3, 20, 1056}, cuda);
  auto weights = torch::rand({20, 20}, cuda).tril(-1);
  auto expected_lower =
      torch::matmul(weights.to(torch::kFloat64), held_by_set(states, 1024).to(torch::kFloat64));
  check_packed_result(
      mix_block_states(weights, packed_set(states, 1024), MixPattern::lower, 1024, true),
      expected_lower, 1024, torch::full_like(expected_lower, 1e-6) * expected_lower.abs().max());
  auto packed = packed_set(states, 1024);
  CHECK(test::contains(
      test::error_of([&] { mix_block_states(weights, packed, MixPattern::dense, 0, true); }),
      "block state mix: a packed input needs a packed output of the same matrix part"));
  auto m = torch::rand({20, 20}, cuda);
  CHECK(
      test::contains(test::error_of([&] { mix_block_states_backward(m, packed, packed, 0, true); }),
                     "multiple of 8 (above 0 for packed inputs)"));
#else
  WARN("built without the CUDA kernels: skipped");
#endif
}
