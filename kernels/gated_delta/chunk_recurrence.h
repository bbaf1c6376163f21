#pragma once
// The sequential part of the chunked gated delta rule (see src/attention/delta_chunk_recurrence.h
// for the equations), fp32, forward and backward. One CTA per (batch x head, 32 value columns):
// the state's columns evolve independently, so a CTA keeps its [Dk, 32] slice in shared memory
// and walks the chunks in order (forward) or in reverse (backward), each chunk two small
// products against the chunk's W and Kt tiles, also staged in shared memory.
//   forward:  per_chunk_state_i = S_i;  y_i = x_i - W_i S_i;  S_{i+1} = D_i S_i + Kt_i^T y_i
//   backward: per_chunk_state_i = dS_{i+1};  y_i = x_i + Kt_i dS_{i+1};
//             dS_i = D_i dS_{i+1} + state_grad_in_i - W_i^T y_i
#include <cstdint>

#include <cuda_runtime.h>

namespace mhla_kernels {

constexpr int kDeltaChunkMaxKeyDim = 256;  // and a multiple of 4
constexpr int kDeltaChunkMaxChunk = 64;

struct DeltaChunkArgs {
  int batch_heads = 0, chunks = 0, chunk = 0, key_dim = 0, value_dim = 0;
  const float* x = nullptr;              // [BH, n, C, Dv]: u0 (forward) / du (backward)
  const float* w = nullptr;              // [BH, n, C, Dk]
  const float* kt = nullptr;             // [BH, n, C, Dk]
  const float* decay = nullptr;          // [BH, n, Dk]
  const float* state_in = nullptr;       // [BH, Dk, Dv]: S_0 (forward) / dS_n (backward)
  const float* state_grad_in = nullptr;  // [BH, n, Dk, Dv]: dS_i from the outputs (backward)
  float* per_chunk_state = nullptr;      // [BH, n, Dk, Dv]
  float* y = nullptr;                    // [BH, n, C, Dv]
  float* state_out = nullptr;            // [BH, Dk, Dv]: S_n (forward) / dS_0 (backward)
};

cudaError_t delta_chunk_forward(const DeltaChunkArgs& args, cudaStream_t stream);
cudaError_t delta_chunk_backward(const DeltaChunkArgs& args, cudaStream_t stream);

}  // namespace mhla_kernels
