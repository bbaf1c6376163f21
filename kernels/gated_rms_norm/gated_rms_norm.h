#pragma once
// Gated RMSNorm over each head's vector (causal MHLA's output stage):
//   y = x * rstd * w * silu(g),   rstd = 1 / sqrt(mean(x^2) + eps)   over the last D elements,
// with x and g in one dtype (bf16 under autocast) and y written in it. ATen runs this as rms_norm
// (fp32 output under autocast), silu, a mixed-dtype multiply and a cast, and about twice as many
// passes backward. Here: one pass forward (rstd kept per vector), one pass backward for dx and dg,
// with dw summed per CTA in shared memory and then over CTAs (no atomics, deterministic).
//   dn = dy w s,  dx = rstd (dn - n mean(dn n)),  dg = dy n w sigmoid(g) (1 + g (1 - sigmoid(g))),
//   dw = sum over vectors of dy n s,   where n = x rstd and s = silu(g).
// D must be 32, 64, 128 or 256 (one warp per vector, D / 32 elements per lane).
#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

#include "mhla/block_linear_attention.h"  // DType

namespace mhla_kernels {

bool gated_rms_norm_supports(int dim);

struct GatedRmsNormArgs {
  DType dtype = DType::bf16;  // x, g, y, dy, dx, dg
  int64_t vectors = 0;        // rows * heads
  int dim = 0;
  float eps = 1e-6f;
  const void* x = nullptr;        // [vectors, dim] contiguous
  const void* gate = nullptr;     // [vectors, dim]
  const float* weight = nullptr;  // [dim]
  float* rstd = nullptr;          // [vectors]: written forward, read backward
  void* y = nullptr;              // forward output [vectors, dim]
  const void* dy = nullptr;       // backward input
  void* dx = nullptr;             // backward outputs
  void* dgate = nullptr;
  float* dweight = nullptr;    // [dim]
  float* workspace = nullptr;  // gated_rms_norm_workspace_floats(vectors, dim)
};

cudaError_t gated_rms_norm_forward(const GatedRmsNormArgs& args, cudaStream_t stream);
size_t gated_rms_norm_workspace_floats(int64_t vectors, int dim);
cudaError_t gated_rms_norm_backward(const GatedRmsNormArgs& args, cudaStream_t stream);

}  // namespace mhla_kernels
