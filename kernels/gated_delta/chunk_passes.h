#pragma once
// The passes of the fused gated-delta kernels, in the order the entry points of chunk_fused.cu
// run them (see chunk_fused.h for the math). Each launches over the whole batch, for the chunks
// [chunk_begin, chunk_end) of GatedDeltaArgs.
#include <cuda_runtime.h>

#include "gated_delta/chunk_fused.h"

namespace mhla_kernels {
namespace gated_delta {

// Segments of a pipelined walk (gated_delta_walk_segments in chunk_fused.h).
int walk_segments(const GatedDeltaArgs& a);

// Forward.
cudaError_t run_prepare(const GatedDeltaArgs& a, cudaStream_t stream);         // G, W, U0
cudaError_t run_states_forward(const GatedDeltaArgs& a, cudaStream_t stream);  // S_i, u, S_n
cudaError_t run_output(const GatedDeltaArgs& a, cudaStream_t stream);          // o
// Backward.
cudaError_t run_states_backward(const GatedDeltaArgs& a, cudaStream_t stream);  // dS, du, dS_0
cudaError_t run_chunk_grads(const GatedDeltaArgs& a, cudaStream_t stream);  // dq, dk, dv, dbeta, dg

// KDA (per-key gates): its own prepare and per-chunk gradient passes; the states, output and
// local value passes above take it through GatedDeltaArgs::per_key_gate.
cudaError_t run_kda_prepare(const GatedDeltaArgs& a, cudaStream_t stream);  // G, P, K~, W, U0, ...
cudaError_t run_kda_chunk_grads(const GatedDeltaArgs& a, cudaStream_t stream);  // dq, dk', dW, dG'
cudaError_t run_kda_wy_backward(const GatedDeltaArgs& a, cudaStream_t stream);  // dk, dv, dbeta, dg

}  // namespace gated_delta
}  // namespace mhla_kernels
