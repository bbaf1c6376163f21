// When the fragment passes take their pipelined variants (fragment_pipeline.cuh).
#include <cstdlib>
#include <string>

#include "mhla/block_fragment_passes.h"
#include "mhla/tiles.cuh"

namespace mhla_kernels {

bool fragment_pipelined_variants(const BlockLinearShape& shape, DType dtype, int chunks) {
  static const bool enabled = [] {
    const char* value = std::getenv("MHLA_PIPELINED_PASSES");
    return value == nullptr || std::string(value) != "0";
  }();
  return enabled && dtype == DType::bf16 && chunks == 1 &&
         fragment_passes_supported(dtype, shape.head_dim) && shape.blocks >= 1 &&
         shape.tokens / shape.blocks <= tiles::kTile;
}

bool fragment_chunk_pipelined(const BlockLinearShape& shape, DType dtype) {
  static const bool enabled = [] {
    const char* value = std::getenv("MHLA_PIPELINED_CHUNKS");
    return value == nullptr || std::string(value) != "0";
  }();
  return enabled && dtype == DType::bf16 && fragment_passes_supported(dtype, shape.head_dim) &&
         shape.blocks >= 1 && shape.tokens / shape.blocks > tiles::kTile;
}

}  // namespace mhla_kernels
