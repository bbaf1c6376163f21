#pragma once
// The hinge between two adaLN-Zero branches of a DiT block, forward and backward, in one pass
// each way:
//   sum    = x + gate[sample] * branch                 (the fp32 residual stream)
//   normed = LayerNorm(sum) * (1 + scale[sample]) + shift[sample]   (no affine; the next branch's
//   input)
// gate, shift and scale are per-sample vectors over the columns (rows of the block's modulation
// output). Why: as ATen ops the hinge is a strided broadcast multiply, a mixed-dtype add, the norm,
// a second broadcast multiply and an add, and the backward adds per-sample column sums of three
// products; at DiT-S/2 with 1,024 tokens those ops took about 65 ms of a 190 ms training step.
// Here the backward writes the per-sample column sums (d shift, d scale, d gate) from per-CTA
// partials summed in a fixed order: deterministic, no atomics.
#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

#include "mhla/block_linear_attention.h"  // DType

namespace mhla_kernels {

constexpr int kAdaLnMaxColumns = 1024;

// A per-sample vector: element (sample, col) at data[sample * stride + col] (fp32).
struct SampleVectors {
  const float* data = nullptr;
  int64_t stride = 0;
};

struct AdaLnForwardArgs {
  DType dtype = DType::bf16;  // branch and normed
  int64_t samples = 0;
  int64_t rows_per_sample = 0;  // rows = samples * rows_per_sample
  int cols = 0;                 // <= kAdaLnMaxColumns
  float eps = 1e-6f;
  const float* x = nullptr;      // [rows, cols] fp32
  const void* branch = nullptr;  // [rows, cols] or null: no residual add (sum is x, not written)
  SampleVectors gate;            // null data: 1
  SampleVectors shift, scale;    // required
  float* sum = nullptr;          // [rows, cols] fp32; required with branch
  void* normed = nullptr;        // [rows, cols]
  float* mean = nullptr;         // [rows]; may be null with rstd (inference)
  float* rstd = nullptr;
};

cudaError_t adaln_forward(const AdaLnForwardArgs& args, cudaStream_t stream);

struct AdaLnBackwardArgs {
  DType dtype = DType::bf16;  // branch, dnormed and dbranch
  int64_t samples = 0;
  int64_t rows_per_sample = 0;
  int cols = 0;
  const float* sum = nullptr;     // the normalized rows (the forward's sum, or x without branch)
  const void* dnormed = nullptr;  // [rows, cols]
  const float* mean = nullptr;    // [rows]
  const float* rstd = nullptr;
  SampleVectors scale;           // the forward's
  const float* dsum = nullptr;   // [rows, cols] gradient from the sum's other uses; null: none
  const void* branch = nullptr;  // with a residual add: the forward's branch, for d gate
  SampleVectors gate;            // null data: 1
  float* dx = nullptr;           // [rows, cols] fp32 (the sum's total gradient)
  void* dbranch = nullptr;       // [rows, cols]; null without branch
  // [samples, 3, cols] fp32: d shift, d scale, d gate (d gate is the column sum of d sum * branch
  // even without a gate, and zero without a branch).
  float* dmodulation = nullptr;
  float* workspace = nullptr;  // adaln_backward_workspace_floats(samples, rows_per_sample, cols)
};

size_t adaln_backward_workspace_floats(int64_t samples, int64_t rows_per_sample, int cols);
cudaError_t adaln_backward(const AdaLnBackwardArgs& args, cudaStream_t stream);

}  // namespace mhla_kernels
