#pragma once
// LayerNorm over the last dimension for every model. On a CUDA tensor it runs our kernels
// (kernels/layer_norm): under bf16/fp16 autocast the output comes out in the autocast dtype (the
// next matmul's input) instead of fp32, and the weight/bias gradient is reduced without ATen's
// slow few-columns path. Elsewhere, or with MHLA_FUSED_NORM=0 in the environment, it is
// torch::layer_norm. Parameters are named weight and bias like torch::nn::LayerNorm's, so
// checkpoints keep their keys.
#include <torch/torch.h>

namespace mhla {

// y = (x - mean) / sqrt(var + eps) * weight + bias over the last dimension; weight and bias both
// defined or both undefined.
torch::Tensor layer_norm(const torch::Tensor& x, const torch::Tensor& weight,
                         const torch::Tensor& bias, double eps);

// Whether the norm and residual kernels are built and not switched off (MHLA_FUSED_NORM=0): the
// one reading of that switch for every binding that follows it.
bool norm_kernels_enabled();

// Whether layer_norm(x, weight, ...) takes the CUDA kernels.
bool layer_norm_uses_kernel(const torch::Tensor& x, const torch::Tensor& weight);

class LayerNormImpl : public torch::nn::Module {
 public:
  explicit LayerNormImpl(int64_t dim, bool affine = true, double eps = 1e-5);
  torch::Tensor forward(const torch::Tensor& x);
  int64_t dim() const { return dim_; }
  double eps() const { return eps_; }

  torch::Tensor weight, bias;  // undefined without affine

 private:
  int64_t dim_;
  double eps_;
};
TORCH_MODULE(LayerNorm);

}  // namespace mhla
