#pragma once
// The linear layer of every model.
//
// Forward: ATen's linear (one addmm with the bias fused into the matmul for contiguous inputs of
// any rank). The C++ frontend's functional linear instead multiplies and then adds the bias in
// place (`output += bias`) for inputs of more than two dimensions; under autocast that is a
// bf16 += fp32 broadcast add, which ATen runs as a slow non-vectorized kernel over every
// activation (on the H200 the largest kernel of a DeiT step: 5.9 of 26.3 GPU ms, 49 calls = one
// per linear layer).
//
// Backward on CUDA: our autograd function, whose bias gradient is the fp32 column sum of
// kernels/column_sum instead of ATen's bf16 reduction (4.4 of 26.3 GPU ms of the same step; with
// it a DeiT-T/2 MHLA step went from 11,668 to 13,947 img/s on the H200, session 6).
// MHLA_LINEAR_BIAS_KERNEL=0 falls back to ATen's backward for A/B comparisons.
//
// Same parameters, names, options and initialization as torch::nn::Linear, so checkpoints are
// unchanged.
#include <torch/torch.h>

namespace mhla {

// x W^T + b; autocast applies as to torch::linear.
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& weight,
                     const torch::Tensor& bias);

// The same through the explicit autograd function (the GPU path; on the CPU its bias
// gradient is an fp32 torch sum), exposed so tests can check it against torch::linear.
torch::Tensor linear_with_own_backward(const torch::Tensor& x, const torch::Tensor& weight,
                                       const torch::Tensor& bias);

// The dtype a linear layer multiplies x in: autocast's for floating inputs under autocast (not
// fp64), else x's own.
torch::ScalarType linear_compute_dtype(const torch::Tensor& x);

// Sums over the rows of a [rows, cols] gradient (a bias gradient), in fp32 (fp64 for fp64
// gradients): kernels/column_sum on CUDA.
torch::Tensor column_sums(const torch::Tensor& grad);
// The same into `out` (fp32 [cols], contiguous, on grad's device), in a fixed order on every
// device: also the ordered sum of per-CTA parts (train.deterministic, core/determinism.h).
void column_sums_into(const torch::Tensor& grad, const torch::Tensor& out);

class LinearImpl : public torch::nn::LinearImpl {
 public:
  using torch::nn::LinearImpl::LinearImpl;
  torch::Tensor forward(const torch::Tensor& input) { return linear(input, weight, bias); }
};
TORCH_MODULE(Linear);

}  // namespace mhla
