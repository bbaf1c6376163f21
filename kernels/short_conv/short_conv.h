#pragma once
// The gated delta layers' input stage in one pass each way: a depthwise causal convolution of
// width W = 4 over time on the fused q/k/v projection, SiLU, and L2 normalization of each head's
// q and k (fla's ShortConvolution followed by the layer's activations):
//   p[t, c] = sum_j w[c, j] x[t - W + 1 + j, c]   (zero before the first token)
//   s = silu(p);  q_h = s_q,h / max(|s_q,h|, eps),  k_h likewise,  v = s_v
// x is the projection [B, T, 3, H, D] (rows of 3 H D: the q, k and v parts); q, k, v come out as
// three contiguous [B, T, H, D] tensors, ready for the delta-rule kernels. ATen runs this as a
// transpose and pad, a depthwise conv, a transpose back, SiLU and two strided normalizations,
// each with its own backward, most of them over strided memory.
//
// reversed: the sequence is read back to front (output token t from input token T - 1 - t), so a
// bidirectional layer's backward scan needs no flipped copy of its input; outputs are in the
// reversed order, gradients are written in x's order.
//
// Backward recomputes p from x and w (nothing but x is kept) and writes dx [B, T, 3 H D] and
// dw [3 H D, W] (fp32; summed per CTA, then over CTAs: no atomics, deterministic):
//   ds = dq_h/n - y (y . dq_h)/n with y = q_h and n = |s_q,h| (ds = dq_h / eps where clamped),
//   dp = ds sigmoid(p) (1 + p (1 - sigmoid(p))),
//   dx[t] = sum_j w[j] dp[t + W - 1 - j],  dw[j] = sum over b, t of dp[t] x[t - W + 1 + j].
// One warp per (sequence, head, part) run of tokens; D / 32 channels per lane, D in {32, 64, 128}.
#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

#include "mhla/block_linear_attention.h"  // DType

namespace mhla_kernels {

inline constexpr int kShortConvWidth = 4;

bool short_conv_supports(int head_dim, int width);

struct ShortConvArgs {
  DType dtype = DType::bf16;  // x, q, k, v and their gradients
  int batch = 0, tokens = 0, heads = 0, head_dim = 0;
  bool reversed = false;
  float eps = 1e-6f;        // of the L2 normalization
  const void* x = nullptr;  // [B, T, 3, H, D] contiguous
  const float* weight = nullptr;  // [3 H D, W] contiguous
  void* q = nullptr;              // forward outputs [B, T, H, D] contiguous
  void* k = nullptr;
  void* v = nullptr;
  const void* dq = nullptr;  // backward inputs [B, T, H, D] contiguous
  const void* dk = nullptr;
  const void* dv = nullptr;
  void* dx = nullptr;          // backward outputs [B, T, 3, H, D]
  float* dweight = nullptr;    // [3 H D, W]
  float* workspace = nullptr;  // short_conv_workspace_floats(args)
};

cudaError_t short_conv_forward(const ShortConvArgs& args, cudaStream_t stream);
size_t short_conv_workspace_floats(const ShortConvArgs& args);
cudaError_t short_conv_backward(const ShortConvArgs& args, cudaStream_t stream);

}  // namespace mhla_kernels
