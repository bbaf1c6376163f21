#pragma once
// A set of fp32 states (S as D x D then z as D floats, block_linear_attention.h) rewritten as a
// packed set (S as D x D bf16, then z in fp32: block_linear_packed_floats). Linear attention's
// states and their gradients are sums over many chunks' CTAs (fp32 adds); packed, the passes that
// read them take their pipelined forms (fragment_pipeline.cuh), which copy packed states only.
// The passes round S to bf16 when they load it anyway, so their results are unchanged.
#include <cuda_runtime.h>

#include <cstdint>

namespace mhla_kernels {

// states sets of D x D + D floats at `set` into `packed` (D * D / 2 + D floats each); D in {32,
// 64, 128}, both buffers 16-byte aligned.
cudaError_t pack_state_set(const float* set, float* packed, int64_t states, int head_dim,
                           cudaStream_t stream);

}  // namespace mhla_kernels
