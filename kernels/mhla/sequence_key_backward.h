#pragma once
// MHLA's backward after the query pass in one kernel, for sequences of at most 16 blocks of 64
// tokens (N = 64 M, head dim 64, bf16): the mix backward and the key pass of the state kernels
// (block_linear_attention.h), with the mixed gradients kept in shared memory.
//
//   dS_j = sum_i m_ij dS'_i,  dz_j = sum_i m_ij dz'_i           (per (batch, head), on chip)
//   dm_ij += <dS'_i, S_j> + <dz'_i, z_j>                        (fp32, added once per CTA)
//   dv_t = phi(k_t) dS_j,  dk_t = phi'(k_t)^T (dS_j v_t + dz_j)   (t in block j)
//
// Why: at M = 16 blocks of 64 tokens a (batch, head)'s states are as many bytes as its keys and
// values. The separate mix kernel wrote dS as a packed set and the key pass read it back: 100 of
// the 400 MB those two kernels moved at B = 64, N = 1,024, H = 6 (42 + 68 us on the H200,
// session 44). Here one persistent CTA per (batch, head) at a time mixes dS'_i (the query pass's
// packed set) into the 16 dS_j in shared memory and then runs the key side of every token over
// them.
#include "mhla/block_linear_attention.h"

namespace mhla_kernels {

struct SequenceKeyBackward {
  BlockLinearShape shape;
  DType dtype = DType::bf16;
  TokenTensor k, v;
  const float* mixing = nullptr;      // [M, M] fp32
  const float* grad_mixed = nullptr;  // packed set (block_linear_packed_floats): dS'_i, dz'_i
  const float* states = nullptr;      // packed set: S_j, z_j (the forward's)
  void* grad_k = nullptr;             // [B, N, H, D] contiguous
  void* grad_v = nullptr;             // [B, N, H, D] contiguous
  float* grad_mixing = nullptr;       // [M, M]: the products ADDED (atomics)
  // Deterministic sums: CTA c writes its [M, M] sums to part c instead
  // (sequence_key_backward_parts() of them), for the caller to add in a fixed order.
  float* grad_mixing_parts = nullptr;
};

// The shapes the kernel computes: bf16, head dim 64, N = 64 M with 1 <= M <= 16.
bool sequence_key_backward_supported(const BlockLinearShape& shape, DType dtype);
// The shape, k and v views with 16-byte aligned bases and strides, 16-byte aligned outputs and
// sets.
bool sequence_key_backward_takes(const SequenceKeyBackward& args);
// The CTAs of the launch (the parts of grad_mixing_parts) for this shape.
int sequence_key_backward_parts(const BlockLinearShape& shape);
// cudaErrorInvalidValue for arguments it does not take.
cudaError_t sequence_key_backward(const SequenceKeyBackward& args, cudaStream_t stream);

}  // namespace mhla_kernels
