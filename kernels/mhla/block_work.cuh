#pragma once
// Which tokens one CTA of the bidirectional block-linear passes covers: grid (blocks * chunks,
// batch * heads), CTA x = block j's chunk c of at most kChunk tokens.
#include "mhla/block_linear_attention.h"
#include "mhla/tiles.cuh"

namespace mhla_kernels {
namespace tiles {

struct Work {  // the token range of one CTA: block j, chunk c, [begin, end)
  int bh, b, h, block, begin, end;
};

__device__ __forceinline__ Work work_of(const BlockLinearShape& s, int chunks) {
  Work w;
  w.bh = blockIdx.y;
  w.b = w.bh / s.heads;
  w.h = w.bh % s.heads;
  w.block = blockIdx.x / chunks;
  const int chunk = blockIdx.x % chunks, length = s.tokens / s.blocks;
  w.begin = w.block * length + chunk * kChunk;
  w.end = min(w.begin + kChunk, (w.block + 1) * length);
  return w;
}

}  // namespace tiles
}  // namespace mhla_kernels
