#pragma once
// Which tokens one CTA of the bidirectional block-linear passes covers: grid (blocks * chunks,
// batch * heads), CTA x = block j's chunk c of at most kChunk tokens.
#include "mhla/block_linear_attention.h"
#include "mhla/tiles.cuh"

namespace mhla_kernels {
namespace tiles {

struct Work {  // the token range of one CTA: block j, chunk c, [begin, end)
  int bh, b, h, block, chunk, begin, end;
};

__device__ __forceinline__ Work work_of(const BlockLinearShape& s, int chunks) {
  Work w;
  w.bh = blockIdx.y;
  w.b = w.bh / s.heads;
  w.h = w.bh % s.heads;
  w.block = blockIdx.x / chunks;
  w.chunk = blockIdx.x % chunks;
  const int length = s.tokens / s.blocks;
  w.begin = w.block * length + w.chunk * kChunk;
  w.end = min(w.begin + kChunk, (w.block + 1) * length);
  return w;
}

// Where a CTA writes its block's state (floats per state `state_floats`, states B * H * M): into
// the state set itself, or, with ordered sums (BlockLinearForward::chunk_parts), into its chunk's
// set of the parts.
__device__ __forceinline__ float* state_target(float* set, float* chunk_parts,
                                               const BlockLinearShape& s, const Work& w,
                                               size_t state_floats) {
  const size_t index = static_cast<size_t>(w.bh) * s.blocks + w.block;
  if (chunk_parts == nullptr) return set + index * state_floats;
  const size_t states = static_cast<size_t>(s.batch) * s.heads * s.blocks;
  return chunk_parts + (static_cast<size_t>(w.chunk) * states + index) * state_floats;
}

}  // namespace tiles
}  // namespace mhla_kernels
