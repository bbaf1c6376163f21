#pragma once
// The shape tests call a kernel's support check, bool(const BlockLinearShape&, DType), as
// takes(batch, tokens, heads, head_dim, blocks[, dtype]) with bf16 unless a dtype is given.
#include "mhla/block_linear_attention.h"

namespace mhla::test {

template <typename Supported>
auto shape_predicate(Supported supported) {
  return [supported](int batch, int tokens, int heads, int head_dim, int blocks,
                     mhla_kernels::DType dtype = mhla_kernels::DType::bf16) {
    return supported(mhla_kernels::BlockLinearShape{batch, tokens, heads, head_dim, blocks}, dtype);
  };
}

}  // namespace mhla::test
