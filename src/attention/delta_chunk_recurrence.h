#pragma once
// The one sequential part of the chunked gated delta rule: the state passed from chunk to chunk.
// Everything else of the chunked WY form (the intra-chunk matrix, the triangular solve, the
// decayed q k^T, the outputs) is computed for all chunks at once by batched ops; this function
// carries the state, for chunk i = 0 .. n-1 (per batch and head):
//   S_i  = the state entering chunk i          (S_0 = the initial state)
//   u_i  = u0_i - W_i S_i                       [C, Dv]
//   S_{i+1} = Diag(decay_i) S_i + Kt_i^T u_i   (Kt_i: the keys decayed to the chunk's end)
// Every column of the state evolves on its own, so the GPU kernels split the value dimension
// over CTAs. The backward runs the same recurrence in reverse for the state gradient and leaves
// the per-chunk products (dW, dKt, ddecay) to batched matmuls.
//
// delta_chunk_recurrence runs kernels/gated_delta/chunk_recurrence on CUDA with fp32 inputs, key
// dim <= 256 (a multiple of 4) and chunk <= 64, the reference loop of LibTorch ops (one pair of
// matmuls per chunk) elsewhere; delta_chunk_recurrence_reference always runs the loop. The
// attention types' `cuda` backend takes the first, `reference` the second.
#include <tuple>

#include <torch/torch.h>

namespace mhla {

struct DeltaChunkStates {
  torch::Tensor states;  // [B, H, n, Dk, Dv]: S_i, the state entering each chunk
  torch::Tensor u;       // [B, H, n, C, Dv]
  torch::Tensor final;   // [B, H, Dk, Dv]: S_n
};

// u0 [B, H, n, C, Dv], w and kt [B, H, n, C, Dk], decay [B, H, n, Dk], s0 [B, H, Dk, Dv]; one
// floating dtype (fp32 or fp64). Differentiable in every input.
DeltaChunkStates delta_chunk_recurrence(const torch::Tensor& u0, const torch::Tensor& w,
                                        const torch::Tensor& kt, const torch::Tensor& decay,
                                        const torch::Tensor& s0);

// Whether the call above runs the CUDA kernels for these inputs.
bool delta_chunk_recurrence_uses_kernel(const torch::Tensor& u0, const torch::Tensor& w);

// The same with the reference loop whatever the device (the GPU test's oracle).
DeltaChunkStates delta_chunk_recurrence_reference(const torch::Tensor& u0, const torch::Tensor& w,
                                                  const torch::Tensor& kt,
                                                  const torch::Tensor& decay,
                                                  const torch::Tensor& s0);

}  // namespace mhla
