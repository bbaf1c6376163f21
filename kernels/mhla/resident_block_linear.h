#pragma once
// Bidirectional block linear attention (plain linear attention and MHLA) for short sequences,
// with the whole sequence of one (batch, head) resident in shared memory: one CTA per
// (batch, head) computes the dense masked form of dense_block_linear.h,
//
//   P_ts = (phi(q_t) . phi(k_s)) m_{block(t), block(s)},   o_t = sum_s P_ts v_s / (sum_s P_ts +
//   eps),
//
// with 16 x 16 score tiles that never leave the registers (mma.sync; the accumulator of one
// product is the operand of the next, as in flash attention, but without a softmax). Every
// 16-token tile lies inside one block, so one mixing weight scales a whole tile. The feature map,
// the normalizer and the mixing are fused; so is the backward's elementwise preparation
// (g = do / (den + eps), gd = -(do . o) / (den + eps)), which the dense kernels leave to the
// caller. Where blocks are short (N = 256 in 16 blocks: states larger than the tokens) this costs
// far less memory traffic than the state kernels.
//
// Takes bf16 or fp16, head dims 32 (N <= 512) and 64 (N <= 256), and blocks of a multiple of 16
// tokens (N % (16 M) == 0); plain linear attention (M = 1) takes any N within the limit.
// Views and outputs as in block_linear_attention.h; den is [B * H, N] fp32 (sum_s P_ts).
#include "mhla/block_linear_attention.h"

namespace mhla_kernels {

struct ResidentBlockLinearForward {
  BlockLinearShape shape;
  DType dtype = DType::bf16;
  TokenTensor q, k, v;
  const float* mixing = nullptr;  // [M, M] fp32, or nullptr (no mixing)
  void* out = nullptr;            // [B, N, H, D] contiguous
  float* den = nullptr;           // [B * H, N]
};

// Which kernel computes the backward where several take the shape (resident_block_linear.cu):
// automatic = the warpgroup kernel, then the state form, then the scores form (or where
// MHLA_RESIDENT_BACKWARD says to start); the others start the order there. A form that does not
// take the shape (or, the warpgroup kernel, the views) falls through to the next.
enum class ResidentBackwardForm { automatic, warpgroup, state, scores };

struct ResidentBlockLinearBackward {
  ResidentBackwardForm form = ResidentBackwardForm::automatic;
  BlockLinearShape shape;
  DType dtype = DType::bf16;
  TokenTensor q, k, v, out, grad_out;  // out: the forward's output
  const float* den = nullptr;          // from the forward
  const float* mixing = nullptr;
  void* grad_q = nullptr;  // [B, N, H, D] contiguous each
  void* grad_k = nullptr;
  void* grad_v = nullptr;
  float* grad_mixing = nullptr;  // [M, M] fp32, overwritten (summed over batch and heads)
  // Deterministic mode: [B * H, M, M] fp32, each (batch, head)'s part of grad_mixing written
  // there (every element) instead of added into grad_mixing with atomics, whose order changes
  // from run to run; the caller sums them in a fixed order. grad_mixing is then not touched.
  float* grad_mixing_parts = nullptr;
};

bool resident_block_linear_supported(const BlockLinearShape& shape, DType dtype);
cudaError_t resident_block_linear_forward(const ResidentBlockLinearForward& args,
                                          cudaStream_t stream);
cudaError_t resident_block_linear_backward(const ResidentBlockLinearBackward& args,
                                           cudaStream_t stream);

}  // namespace mhla_kernels
