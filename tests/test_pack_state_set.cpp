// pack_state_set (kernels/mhla/pack_state_set.h): the fp32 state sets of linear attention
// rewritten as packed sets for the pipelined passes. S must come out exactly as torch rounds it
// to bf16 (round to nearest even), z bit for bit, every state at its own offset. Also which
// shapes take the chunk walk of the pipelined passes and, for linear attention, the packed sets.
#include "catch_compat.h"

#ifdef MHLA_WITH_CUDA_KERNELS
#include <c10/cuda/CUDAStream.h>

#include "linear_attn/linear_attn.h"
#include "mhla/block_fragment_passes.h"
#include "mhla/pack_state_set.h"

namespace {

cudaStream_t current_stream() {
  return c10::cuda::getCurrentCUDAStream().stream();
}

}  // namespace

TEST_CASE("chunk walk: bf16 blocks longer than one tile, D = 32 or 64", "[attention]") {
  using mhla_kernels::DType;
  using mhla_kernels::fragment_chunk_pipelined;
  // {batch, tokens, heads, head_dim, blocks}
  CHECK(fragment_chunk_pipelined({16, 4096, 6, 64, 16}, DType::bf16));        // 256-token blocks
  CHECK(fragment_chunk_pipelined({4, 16384, 6, 64, 16}, DType::bf16));        // 1,024-token blocks
  CHECK(fragment_chunk_pipelined({2, 1000, 3, 32, 4}, DType::bf16));          // 250, D = 32
  CHECK(fragment_chunk_pipelined({64, 1024, 6, 64, 1}, DType::bf16));         // linear attention
  CHECK_FALSE(fragment_chunk_pipelined({64, 1024, 6, 64, 16}, DType::bf16));  // one tile
  CHECK_FALSE(fragment_chunk_pipelined({2, 720, 8, 64, 16}, DType::bf16));    // 45 tokens
  CHECK_FALSE(fragment_chunk_pipelined({16, 4096, 6, 64, 16}, DType::f16));
  CHECK_FALSE(fragment_chunk_pipelined({16, 4096, 6, 64, 16}, DType::f32));
  CHECK_FALSE(fragment_chunk_pipelined({16, 4096, 6, 128, 16}, DType::bf16));
}

TEST_CASE("linear attention packs S and dS exactly where its passes take the chunk walk",
          "[attention]") {
  using mhla_kernels::DType;
  using mhla_kernels::linear_attention_packs_states;
  CHECK(linear_attention_packs_states(65, 64, DType::bf16));
  CHECK(linear_attention_packs_states(16384, 32, DType::bf16));
  CHECK_FALSE(linear_attention_packs_states(64, 64, DType::bf16));  // one tile
  CHECK_FALSE(linear_attention_packs_states(1024, 64, DType::f16));
  CHECK_FALSE(linear_attention_packs_states(1024, 128, DType::bf16));
  // A packed state: D x D bf16 then D fp32, per batch and head.
  CHECK(mhla_kernels::linear_attention_packed_floats(3, 2, 64) == 3u * 2u * (64 * 32 + 64));
}

TEST_CASE("pack_state_set: S rounded to bf16 as torch rounds it, z copied, per state",
          "[attention][gpu]") {
  if (!torch::cuda::is_available()) {
    WARN("no CUDA device: skipped");
    return;
  }
  torch::manual_seed(5);
  for (const int64_t d : {32, 64, 128}) {
    INFO("D = " << d);
    const int64_t states = 7;
    auto options = torch::TensorOptions().device(torch::kCUDA).dtype(torch::kFloat32);
    // Values across many binades, so rounding ties and exponents are exercised.
    auto set = torch::randn({states, d * d + d}, options) *
               torch::pow(2.0, torch::randint(-20, 20, {states, d * d + d}, options));
    auto packed = torch::full({states, d * d / 2 + d}, std::nanf(""), options);
    REQUIRE(mhla_kernels::pack_state_set(set.data_ptr<float>(), packed.data_ptr<float>(), states,
                                         static_cast<int>(d), current_stream()) == cudaSuccess);
    const auto s_bits = packed.narrow(1, 0, d * d / 2).contiguous().view(torch::kBFloat16);
    const auto expected = set.narrow(1, 0, d * d).to(torch::kBFloat16);
    CHECK(torch::equal(s_bits.view(torch::kInt16), expected.contiguous().view(torch::kInt16)));
    CHECK(torch::equal(packed.narrow(1, d * d / 2, d), set.narrow(1, d * d, d)));
  }
}

TEST_CASE("pack_state_set: refuses what it cannot pack", "[attention][gpu]") {
  if (!torch::cuda::is_available()) {
    WARN("no CUDA device: skipped");
    return;
  }
  auto options = torch::TensorOptions().device(torch::kCUDA).dtype(torch::kFloat32);
  auto set = torch::zeros({2 * (64 * 64 + 64) + 4}, options);
  auto packed = torch::zeros({2 * (64 * 32 + 64) + 4}, options);
  float* s = set.data_ptr<float>();
  float* p = packed.data_ptr<float>();
  using mhla_kernels::pack_state_set;
  CHECK(pack_state_set(s, p, 2, 48, current_stream()) == cudaErrorInvalidValue);      // head dim
  CHECK(pack_state_set(s + 1, p, 2, 64, current_stream()) == cudaErrorInvalidValue);  // alignment
  CHECK(pack_state_set(s, p + 2, 2, 64, current_stream()) == cudaErrorInvalidValue);
  CHECK(pack_state_set(s, p, 0, 64, current_stream()) == cudaErrorInvalidValue);  // no states
  CHECK(pack_state_set(nullptr, p, 2, 64, current_stream()) == cudaErrorInvalidValue);
  CHECK(pack_state_set(s, p, 2, 64, current_stream()) == cudaSuccess);
}
#endif
