#pragma once
// The launch shared by the fragment passes (block_fragment_passes.h): a pass's kernel for the
// runtime input type and head dimension, over the passes' grid (one CTA of four warps per
// batch*head, block and chunk), its shared memory opted into once per instantiation.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <cstdlib>
#include <string>
#include <type_traits>

#include "common/dependent_launch.cuh"
#include "common/device_info.h"

#include "mhla/block_fragment_passes.h"
#include "mhla/fragment_rows.cuh"
#include "mhla/tiles.cuh"

namespace mhla_kernels {
namespace fragment_rows {

// Pass<T, D> names the kernel (`kernel`, taking the pass's arguments and the chunks per block)
// and its dynamic shared memory in bytes (`smem`); OneTile<T, D> the same for CTAs of one tile.
template <template <typename, int> class Pass, template <typename, int> class OneTile,
          typename Args>
cudaError_t launch_pass(const Args& a, int chunks, cudaStream_t stream) {
  if (!fragment_passes_supported(a.dtype, a.shape.head_dim) || chunks < 1)
    return cudaErrorInvalidValue;
  const dim3 grid(a.shape.blocks * chunks, a.shape.batch * a.shape.heads);
  auto start = [&](auto pass) {
    using P = decltype(pass);
    static const cudaError_t opted = tiles::allow_smem(P::kernel, P::smem);
    if (opted != cudaSuccess) return opted;
    P::kernel<<<grid, kFragmentThreads, P::smem, stream>>>(a, chunks);
    return cudaGetLastError();
  };
  const bool one_tile = fragment_one_tile_variants(a.shape);
  auto run = [&](auto type, auto dim) {
    using T = decltype(type);
    constexpr int D = decltype(dim)::value;
    return one_tile ? start(OneTile<T, D>{}) : start(Pass<T, D>{});
  };
  using D32 = std::integral_constant<int, 32>;
  using D64 = std::integral_constant<int, 64>;
  const bool bf16 = a.dtype == DType::bf16;
  if (a.shape.head_dim == 64) return bf16 ? run(__nv_bfloat16{}, D64{}) : run(__half{}, D64{});
  return bf16 ? run(__nv_bfloat16{}, D32{}) : run(__half{}, D32{});
}

// A pass without a one-tile variant (the query and key passes: capped at fewer registers they
// spill and ran slower, session 26).
template <template <typename, int> class Pass, typename Args>
cudaError_t launch_pass(const Args& a, int chunks, cudaStream_t stream) {
  return launch_pass<Pass, Pass>(a, chunks, stream);
}

// A pipelined pass (fragment_pipeline.cuh): Pass::kernel(args, chunks) over persistent CTAs, as
// many as fit on the device at once (at most one per item: per block, or per chunk where
// Pass::kChunks), launched as a dependent grid (common/dependent_launch.cuh). Pass::smem as above.
template <class Pass, typename Args>
cudaError_t launch_pipelined(const Args& a, int chunks, cudaStream_t stream) {
  static const int per_multiprocessor = [] {
    int count = 0;
    if (tiles::allow_smem(Pass::kernel, Pass::smem) != cudaSuccess ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&count, Pass::kernel, kFragmentThreads,
                                                      Pass::smem) != cudaSuccess)
      return 0;
    return count;
  }();
  if (per_multiprocessor < 1) return cudaErrorInvalidConfiguration;
  const int64_t items = static_cast<int64_t>(a.shape.batch) * a.shape.heads * a.shape.blocks *
                        (Pass::kChunks ? chunks : 1);
  const int64_t resident = static_cast<int64_t>(per_multiprocessor) * multiprocessors();
  const int ctas = static_cast<int>(items < resident ? items : resident);
  return dependent_launch::launch(Pass::kernel, dim3(ctas), dim3(kFragmentThreads), Pass::smem,
                                  stream, a, chunks);
}

// What launch_pipelined needs of a pipelined pass: its kernel instance, whether it walks chunks,
// and its stage's shared memory.
template <class Stage, void (*Kernel)(BlockLinearBackward, int), bool ByChunks>
struct PipelinedPass {
  static constexpr bool kChunks = ByChunks;
  static constexpr void (*kernel)(BlockLinearBackward, int) = Kernel;
  static constexpr size_t smem = Stage::smem;
};

// Whether a pipelined backward pass takes its one-state stage (four CTAs per SM): yes unless the
// environment variable `name` is "3" (three CTAs, kept for A/B runs). Read once per name by the
// caller's static.
inline bool one_state_unless_three_ctas(const char* name) {
  const char* value = std::getenv(name);
  return value == nullptr || std::string(value) != "3";
}

// Runs a pipelined pass in its one-tile form (blocks of at most one tile) or its chunk form
// (longer blocks): Pass<D, kChunks>, D = 32 or 64.
template <template <int, bool> class Pass, typename Args>
cudaError_t launch_pipelined_form(const Args& a, int chunks, bool by_chunks, cudaStream_t stream) {
  if (a.shape.head_dim == 64) {
    return by_chunks ? launch_pipelined<Pass<64, true>>(a, chunks, stream)
                     : launch_pipelined<Pass<64, false>>(a, chunks, stream);
  }
  return by_chunks ? launch_pipelined<Pass<32, true>>(a, chunks, stream)
                   : launch_pipelined<Pass<32, false>>(a, chunks, stream);
}

}  // namespace fragment_rows
}  // namespace mhla_kernels
