#pragma once
// Cross-entropy of logits [rows, classes] against integer targets, with label smoothing, without
// materializing fp32 log-probabilities. A language model's loss over B*T = 32,768 rows of a
// 8,192-word vocabulary otherwise casts the bf16 logits to fp32 (1 GB), runs log_softmax forward
// and backward over that, and casts the gradient back: about 8 GB of traffic per step. Here:
//
//   forward:  one pass over each row (online max and sum of exponentials, and the row's sum for
//             label smoothing) -> the row's loss and log-sum-exp, fp32;
//   backward: one pass that rereads the row and writes the gradient in the logits' dtype,
//             dlogits_j = g * (exp(x_j - lse) - (1 - eps) [j == target] - eps / classes).
//
// loss = lse - (1 - eps) x_target - eps * mean_j x_j   (torch's label-smoothing convention).
// A target outside [0, classes) gives the row a NaN loss (and NaN gradients), so it cannot pass
// unnoticed. One CTA per row; 16-byte accesses where the row length and alignment allow.
#include <cstdint>

#include <cuda_runtime.h>

#include "mhla/block_linear_attention.h"  // DType

namespace mhla_kernels {

struct CrossEntropyArgs {
  DType dtype = DType::bf16;
  int64_t rows = 0;
  int classes = 0;
  const void* logits = nullptr;  // [rows, classes], rows `row_stride` elements apart
  int64_t row_stride = 0;
  const int64_t* targets = nullptr;  // [rows]
  float label_smoothing = 0.f;
  // forward outputs
  float* loss = nullptr;  // [rows]
  float* lse = nullptr;   // [rows]
  // backward: reads lse (the forward's), writes grad_logits (contiguous [rows, classes], dtype)
  const float* grad_loss = nullptr;  // [rows], the upstream gradient of each row's loss
  void* grad_logits = nullptr;
};

cudaError_t cross_entropy_forward(const CrossEntropyArgs& args, cudaStream_t stream);
cudaError_t cross_entropy_backward(const CrossEntropyArgs& args, cudaStream_t stream);

}  // namespace mhla_kernels
