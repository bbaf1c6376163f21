// Which shapes the `cuda` backend of linear attention and MHLA sends to the resident kernels
// (kernels/mhla/resident_block_linear.h) instead of the state kernels, and where the state
// kernels' fragment passes take their one-tile and pipelined variants (block_fragment_passes.h;
// with MHLA_FRAGMENT_ONE_TILE and MHLA_PIPELINED_PASSES unset). Host-side decisions, so they are
// checked on every machine that builds the kernels, GPU or not; the kernels' numbers are checked by
// the [gpu] op tests.
#include "catch_compat.h"

#ifdef MHLA_WITH_CUDA_KERNELS
#include "kernel_shape_predicate.h"
#include "mhla/block_fragment_passes.h"
#include "mhla/resident_block_linear.h"
#include "mhla/resident_state_backward.h"
#include "mhla/resident_warpgroup_backward.h"

TEST_CASE("resident kernels: the shapes the cuda backend hands them", "[attention]") {
  using mhla_kernels::DType;
  const auto takes = mhla::test::shape_predicate(mhla_kernels::resident_block_linear_supported);
  // Taken: the DeiT/DiT shape (16 blocks of 16 tokens), fp16, D = 32 up to 512 tokens, linear
  // attention (one block) with a partial 16-token strip.
  CHECK(takes(256, 256, 6, 64, 16));
  CHECK(takes(256, 256, 6, 64, 16, DType::f16));
  CHECK(takes(2, 512, 3, 32, 8));
  CHECK(takes(2, 200, 2, 64, 1));
  CHECK(takes(3, 12, 1, 32, 1));
  // Refused: blocks that are not whole 16-token strips, sequences beyond shared memory, D = 128,
  // fp32 (the state kernels' tf32 path), empty shapes.
  CHECK_FALSE(takes(2, 100, 2, 64, 4));
  CHECK_FALSE(takes(1, 256, 1, 32, 64));
  CHECK_FALSE(takes(64, 1024, 6, 64, 16));
  CHECK_FALSE(takes(2, 512, 2, 64, 1));
  CHECK_FALSE(takes(2, 1024, 2, 32, 1));
  CHECK_FALSE(takes(1, 64, 2, 128, 16));
  CHECK_FALSE(takes(256, 256, 6, 64, 16, DType::f32));
  CHECK_FALSE(takes(0, 256, 6, 64, 16));
  CHECK_FALSE(takes(2, 256, 2, 64, 0));
}

TEST_CASE("resident kernels: which MHLA backwards run in state form", "[attention]") {
  using mhla_kernels::DType;
  const auto state_form =
      mhla::test::shape_predicate(mhla_kernels::resident_state_backward_supported);
  // D = 64 with at most 16 blocks (the mixing products' depth) and one strip per warp.
  CHECK(state_form(256, 256, 6, 64, 16));
  CHECK(state_form(256, 256, 6, 64, 16, DType::f16));
  CHECK(state_form(2, 256, 3, 64, 4));
  CHECK(state_form(3, 128, 2, 64, 8));
  CHECK(state_form(2, 200, 2, 64, 1));
  // Not: D = 32 (the scores form), what the resident kernels refuse, fp32.
  CHECK_FALSE(state_form(2, 512, 3, 32, 8));
  CHECK_FALSE(state_form(2, 256, 2, 32, 16));
  CHECK_FALSE(state_form(64, 1024, 6, 64, 16));
  CHECK_FALSE(state_form(2, 100, 2, 64, 4));
  CHECK_FALSE(state_form(256, 256, 6, 64, 16, DType::f32));
}

TEST_CASE("resident kernels: which backwards run on warpgroup products", "[attention]") {
  using mhla_kernels::DType;
  const auto warpgroup =
      mhla::test::shape_predicate(mhla_kernels::resident_warpgroup_backward_supported);
  // D = 64, whole 64-token tiles up to 256 tokens, blocks of whole 16-token chunks.
  CHECK(warpgroup(256, 256, 6, 64, 16));
  CHECK(warpgroup(256, 256, 6, 64, 16, DType::f16));
  CHECK(warpgroup(2, 256, 3, 64, 4));
  CHECK(warpgroup(3, 128, 2, 64, 8));
  CHECK(warpgroup(2, 64, 2, 64, 1));
  CHECK(warpgroup(2, 192, 2, 64, 3));
  // Not: a partial tile, longer sequences, blocks of 8 tokens, D = 32 or 128, fp32, empty.
  CHECK_FALSE(warpgroup(2, 200, 2, 64, 1));
  CHECK_FALSE(warpgroup(2, 320, 2, 64, 4));
  CHECK_FALSE(warpgroup(2, 256, 2, 64, 32));
  CHECK_FALSE(warpgroup(2, 256, 2, 32, 16));
  CHECK_FALSE(warpgroup(2, 256, 2, 128, 16));
  CHECK_FALSE(warpgroup(2, 256, 2, 64, 16, DType::f32));
  CHECK_FALSE(warpgroup(0, 256, 2, 64, 16));
}

TEST_CASE("resident kernels: the warpgroup backward takes only views the tensor copies can read",
          "[attention]") {
  // A fused qkv projection's views: [B, N, H, D] rows 3 H D apart, heads D apart.
  alignas(16) static unsigned char storage[64];
  mhla_kernels::ResidentBlockLinearBackward args;
  args.shape = {256, 256, 6, 64, 16};
  const auto view = [](const void* data, int64_t token_stride) {
    return mhla_kernels::TokenTensor{data, 256 * token_stride, token_stride, 64};
  };
  args.q = args.k = args.v = view(storage, 3 * 6 * 64);
  args.out = args.grad_out = view(storage, 6 * 64);
  CHECK(mhla_kernels::resident_warpgroup_backward_takes(args));
  // A base off the 16-byte grid (a view that starts one element in), an odd row stride.
  args.k = view(storage + 2, 3 * 6 * 64);
  CHECK_FALSE(mhla_kernels::resident_warpgroup_backward_takes(args));
  args.k = args.q;
  args.grad_out = view(storage, 6 * 64 + 4);
  CHECK_FALSE(mhla_kernels::resident_warpgroup_backward_takes(args));
  args.grad_out = args.out;
  args.shape.head_dim = 32;  // and still only the shapes it supports
  CHECK_FALSE(mhla_kernels::resident_warpgroup_backward_takes(args));
}

TEST_CASE("fragment passes: where the states and output passes take their one-tile variants",
          "[attention]") {
  auto one_tile = [](int tokens, int blocks) {
    return mhla_kernels::fragment_one_tile_variants({64, tokens, 6, 64, blocks});
  };
  // Blocks of at most one 64-token tile: MHLA at N = 1,024 in 16 blocks, shorter blocks.
  CHECK(one_tile(1024, 16));
  CHECK(one_tile(256, 4));
  CHECK(one_tile(48, 1));
  // Longer blocks walk several tiles per CTA and keep the double-buffered passes: linear
  // attention (one block), MHLA at N >= 2,048 in 16 blocks.
  CHECK_FALSE(one_tile(1024, 1));
  CHECK_FALSE(one_tile(2048, 16));
  CHECK_FALSE(one_tile(16384, 16));
  CHECK_FALSE(one_tile(130, 2));
}

TEST_CASE("fragment passes: where the query and key passes take their pipelined variants",
          "[attention]") {
  using mhla_kernels::DType;
  auto pipelined = [](int tokens, int blocks, int head_dim = 64, DType dtype = DType::bf16,
                      int chunks = 1) {
    return mhla_kernels::fragment_pipelined_variants({64, tokens, 6, head_dim, blocks}, dtype,
                                                     chunks);
  };
  // bf16 blocks of at most one tile (packed states exist for bf16 only), D = 32 or 64.
  CHECK(pipelined(1024, 16));
  CHECK(pipelined(720, 16));  // 45-token blocks: a partial tile
  CHECK(pipelined(256, 16, 32));
  CHECK(pipelined(64, 1));
  CHECK_FALSE(pipelined(1024, 16, 64, DType::f16));
  CHECK_FALSE(pipelined(1024, 16, 64, DType::f32));
  CHECK_FALSE(pipelined(1024, 16, 128));
  CHECK_FALSE(pipelined(2048, 16));  // 128-token blocks: two tiles per CTA
  CHECK_FALSE(pipelined(1024, 16, 64, DType::bf16, 2));
}
#endif
