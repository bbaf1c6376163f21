#include "models/layer_norm.h"

#include "core/environment.h"
#include "core/error.h"

#ifdef MHLA_WITH_CUDA_KERNELS
#include <ATen/autocast_mode.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "core/cuda_stream.h"
#include "core/kernel_dtype.h"
#include "layer_norm/layer_norm.h"
#include "models/layer_norm_launch.h"
#endif

namespace mhla {
namespace {

#ifdef MHLA_WITH_CUDA_KERNELS
namespace kernels = mhla_kernels;
using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;

// Weight and bias arrive as 0-element tensors when the norm has no affine part: a custom
// Function's tensor arguments must be defined.
class LayerNormFunction : public torch::autograd::Function<LayerNormFunction> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& weight, const torch::Tensor& bias, double eps,
                               torch::ScalarType out_type) {
    c10::cuda::CUDAGuard on_device(x.device());
    auto input = x.contiguous();
    const int64_t cols = input.size(-1), rows = input.numel() / cols;
    auto y = torch::empty(input.sizes(), input.options().dtype(out_type));
    auto stats = torch::empty({2, rows}, input.options().dtype(torch::kFloat32));
    kernels::LayerNormForwardArgs a;
    a.in_dtype = *kernel_dtype_of(input.scalar_type());
    a.out_dtype = *kernel_dtype_of(out_type);
    a.rows = rows, a.cols = static_cast<int>(cols), a.eps = static_cast<float>(eps);
    a.x = input.data_ptr();
    a.weight = weight.numel() > 0 ? weight.data_ptr<float>() : nullptr;
    a.bias = bias.numel() > 0 ? bias.data_ptr<float>() : nullptr;
    a.y = y.data_ptr();
    a.mean = stats[0].data_ptr<float>(), a.rstd = stats[1].data_ptr<float>();
    const auto err = kernels::layer_norm_forward(a, stream_of(input));
    if (err != cudaSuccess) fail("layer norm (cuda): {}", cudaGetErrorString(err));
    ctx->save_for_backward({input, weight, stats});
    return y;
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto& input = saved[0];
    const auto& weight = saved[1];
    const auto& stats = saved[2];
    c10::cuda::CUDAGuard on_device(input.device());
    auto dy = grads[0].contiguous();
    auto dx = torch::empty_like(input);
    LayerNormParamGrads param_grads;
    const auto a = layer_norm_backward_args(input, dy, stats, weight, dx, param_grads);
    const auto err = kernels::layer_norm_backward(a, stream_of(input));
    if (err != cudaSuccess) fail("layer norm backward (cuda): {}", cudaGetErrorString(err));
    return {dx, param_grads.dweight, param_grads.dbias, torch::Tensor(), torch::Tensor()};
  }
};
#endif

}  // namespace

#ifdef MHLA_WITH_CUDA_KERNELS
torch::ScalarType layer_norm_output_type(const torch::Tensor& x) {
  if (at::autocast::is_autocast_enabled(at::kCUDA)) {
    return at::autocast::get_autocast_dtype(at::kCUDA);
  }
  return x.scalar_type();
}

mhla_kernels::LayerNormBackwardArgs layer_norm_backward_args(const torch::Tensor& x,
                                                             const torch::Tensor& dy,
                                                             const torch::Tensor& stats,
                                                             const torch::Tensor& weight,
                                                             torch::Tensor& dx,
                                                             LayerNormParamGrads& grads) {
  const int64_t cols = x.size(-1), rows = x.numel() / cols;
  auto f32 = x.options().dtype(torch::kFloat32);
  mhla_kernels::LayerNormBackwardArgs a;
  a.in_dtype = *kernel_dtype_of(x.scalar_type());
  a.grad_dtype = *kernel_dtype_of(dy.scalar_type());
  a.rows = rows, a.cols = static_cast<int>(cols);
  a.x = x.data_ptr(), a.dy = dy.data_ptr();
  a.mean = stats[0].data_ptr<float>(), a.rstd = stats[1].data_ptr<float>();
  a.dx = dx.data_ptr();
  if (weight.numel() > 0) {
    grads.dweight = torch::empty({cols}, f32), grads.dbias = torch::empty({cols}, f32);
    grads.workspace = torch::empty(
        {static_cast<int64_t>(mhla_kernels::layer_norm_backward_workspace_floats(rows, a.cols))},
        f32);
    a.weight = weight.data_ptr<float>();
    a.dweight = grads.dweight.data_ptr<float>(), a.dbias = grads.dbias.data_ptr<float>();
    a.workspace = grads.workspace.data_ptr<float>();
  }
  return a;
}
#endif

bool norm_kernels_enabled() {
#ifdef MHLA_WITH_CUDA_KERNELS
  static const bool enabled = environment_switch("MHLA_FUSED_NORM", true);
  return enabled;
#else
  return false;
#endif
}

bool layer_norm_uses_kernel(const torch::Tensor& x, const torch::Tensor& weight) {
#ifdef MHLA_WITH_CUDA_KERNELS
  // Empty inputs take torch's path (the kernels take no null pointers).
  if (!norm_kernels_enabled() || !x.is_cuda() || x.dim() == 0 || x.numel() == 0 ||
      !kernel_dtype_of(x.scalar_type())) {
    return false;
  }
  const int64_t cols = x.size(-1);
  if (cols <= 0 || cols > kernels::kLayerNormMaxColumns) return false;
  if (weight.defined() &&
      (weight.scalar_type() != torch::kFloat32 || weight.device() != x.device() ||
       weight.numel() != cols || !weight.is_contiguous())) {
    return false;
  }
  return true;
#else
  (void)x;
  (void)weight;
  return false;
#endif
}

torch::Tensor layer_norm(const torch::Tensor& x, const torch::Tensor& weight,
                         const torch::Tensor& bias, double eps) {
  if (weight.defined() != bias.defined())
    fail("layer_norm: weight and bias must both be given or both be absent");
#ifdef MHLA_WITH_CUDA_KERNELS
  if (layer_norm_uses_kernel(x, weight) &&
      (!bias.defined() || (bias.scalar_type() == torch::kFloat32 && bias.is_contiguous() &&
                           bias.device() == x.device()))) {
    auto none = torch::empty({0}, x.options().dtype(torch::kFloat32));
    return LayerNormFunction::apply(x, weight.defined() ? weight : none,
                                    bias.defined() ? bias : none, eps, layer_norm_output_type(x));
  }
#endif
  return torch::layer_norm(x, {x.size(-1)}, weight, bias, eps);
}

LayerNormImpl::LayerNormImpl(int64_t dim, bool affine, double eps) : dim_(dim), eps_(eps) {
  if (affine) {
    weight = register_parameter("weight", torch::ones({dim}));
    bias = register_parameter("bias", torch::zeros({dim}));
  }
}

torch::Tensor LayerNormImpl::forward(const torch::Tensor& x) {
  if (x.dim() == 0 || x.size(-1) != dim_) {
    fail("layer norm: input's last dimension is {}, the layer normalizes {}",
         x.dim() == 0 ? 0 : x.size(-1), dim_);
  }
  return layer_norm(x, weight, bias, eps_);
}

}  // namespace mhla
