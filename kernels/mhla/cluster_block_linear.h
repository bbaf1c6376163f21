#pragma once
// Bidirectional block linear attention (plain linear attention and MHLA) with one thread-block
// cluster of 16 CTAs per (batch, head), so the block states never leave the chip.
//
// CTA c of a cluster owns the token span [c N/16, (c+1) N/16), a part of block c M/16. It sums
// its state S_c = phi(K_c)^T [V_c, 1] in shared memory; the CTAs then mix the states through
// distributed shared memory, each taking a 1/16 slice of the state elements of all sixteen
// (S'_c = sum_c' w(c, c') S_c', with w(c, c') = m_{block(c), block(c')}, or 1 for linear
// attention), and each CTA finishes its outputs from the mixed state written into its own shared
// memory. The backward pass recomputes S and S' the same way (the forward saves nothing but its
// output), forms dS'_c with dq, mixes dS'_c back (dS_c = sum_c' w(c', c) dS'_c') together with
// the mixing gradient dm, and finishes with dk and dv. Global traffic is the token tensors only:
// q, k, v read and o written forward; q, k, v, dO read and dq, dk, dv written backward (k and v
// are read twice, the second time mostly from L2).
//
// The state kernels of block_linear_attention.h move D x (D + 1) fp32 states per block through
// global memory, which at 64-token blocks is as many bytes as the tokens themselves.
//
// Takes bf16 or fp16, head dims 32 and 64, blocks M dividing 16 and N % 16 == 0, on a GPU with
// thread-block clusters of 16 (sm_90). Views and outputs as in block_linear_attention.h.
#include "mhla/block_linear_attention.h"

namespace mhla_kernels {

constexpr int kAttentionClusterSize = 16;

struct ClusterBlockLinearForward {
  BlockLinearShape shape;
  DType dtype = DType::bf16;
  TokenTensor q, k, v;
  const float* mixing = nullptr;  // [M, M] fp32, or nullptr (linear attention: all weights 1)
  void* out = nullptr;            // [B, N, H, D] contiguous
};

struct ClusterBlockLinearBackward {
  BlockLinearShape shape;
  DType dtype = DType::bf16;
  TokenTensor q, k, v, grad_out;
  const float* mixing = nullptr;
  void* grad_q = nullptr;  // [B, N, H, D] contiguous each
  void* grad_k = nullptr;
  void* grad_v = nullptr;
  float* grad_mixing = nullptr;  // [M, M] fp32, overwritten (summed over batch and heads)
};

// The shapes and dtypes the kernels take (host-side), and that plus a device with clusters of 16
// (queried once).
bool cluster_block_linear_shape_ok(const BlockLinearShape& shape, DType dtype);
bool cluster_block_linear_supported(const BlockLinearShape& shape, DType dtype);
// How many clusters of the bf16, D = 64 forward or backward kernel the device holds at once
// (cudaOccupancyMaxActiveClusters; -1 on error). For diagnostics: block_linear_smoke --occupancy.
int cluster_block_linear_max_active_clusters(bool backward);

cudaError_t cluster_block_linear_forward(const ClusterBlockLinearForward& args,
                                         cudaStream_t stream);
cudaError_t cluster_block_linear_backward(const ClusterBlockLinearBackward& args,
                                          cudaStream_t stream);

}  // namespace mhla_kernels
