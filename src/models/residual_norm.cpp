#include "models/residual_norm.h"

#include "core/environment.h"
#include "core/error.h"
#include "models/residual_add.h"

#ifdef MHLA_WITH_CUDA_KERNELS
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

bool uses_kernel(const torch::Tensor& x, const torch::Tensor& branch, const LayerNormImpl& norm) {
  static const bool enabled = environment_switch("MHLA_FUSED_RESIDUAL_NORM", true);
  return enabled && layer_norm_uses_kernel(x, norm.weight) && x.scalar_type() == torch::kFloat32 &&
         x.dim() >= 2 && branch.sizes() == x.sizes() && branch.device() == x.device() &&
         branch.scalar_type() == layer_norm_output_type(x) &&
         (!norm.bias.defined() || (norm.bias.scalar_type() == torch::kFloat32 &&
                                   norm.bias.is_contiguous() && norm.bias.device() == x.device()));
}

// weight, bias and scale arrive as 0-element tensors when absent (a custom Function's tensor
// arguments must be defined).
class ResidualNormFunction : public torch::autograd::Function<ResidualNormFunction> {
 public:
  static tensor_list forward(AutogradContext* ctx, const torch::Tensor& x,
                             const torch::Tensor& branch, const torch::Tensor& weight,
                             const torch::Tensor& bias, const torch::Tensor& scale, double eps) {
    c10::cuda::CUDAGuard on_device(x.device());
    auto xc = x.contiguous(), bc = branch.contiguous();
    const int64_t cols = xc.size(-1), rows = xc.numel() / cols;
    auto sum = torch::empty_like(xc);
    auto normed = torch::empty(xc.sizes(), xc.options().dtype(bc.scalar_type()));
    auto stats = torch::empty({2, rows}, xc.options());
    kernels::LayerNormForwardArgs a;
    a.in_dtype = kernels::DType::f32;
    a.out_dtype = *kernel_dtype_of(bc.scalar_type());
    a.rows = rows, a.cols = static_cast<int>(cols), a.eps = static_cast<float>(eps);
    a.x = xc.data_ptr();
    a.weight = weight.numel() > 0 ? weight.data_ptr<float>() : nullptr;
    a.bias = bias.numel() > 0 ? bias.data_ptr<float>() : nullptr;
    a.y = normed.data_ptr();
    a.mean = stats[0].data_ptr<float>(), a.rstd = stats[1].data_ptr<float>();
    a.branch = bc.data_ptr();
    a.scale = scale.numel() > 0 ? scale.data_ptr<float>() : nullptr;
    a.rows_per_sample = rows / xc.size(0);
    a.sum = sum.data_ptr<float>();
    const auto err = kernels::layer_norm_forward(a, stream_of(xc));
    if (err != cudaSuccess) fail("residual add + layer norm (cuda): {}", cudaGetErrorString(err));
    ctx->save_for_backward({sum, weight, stats, scale});
    ctx->saved_data["branch_type"] = static_cast<int64_t>(bc.scalar_type());
    return {sum, normed};
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto& sum = saved[0];
    const auto& weight = saved[1];
    const auto& stats = saved[2];
    const auto& scale = saved[3];
    const auto branch_type = static_cast<torch::ScalarType>(ctx->saved_data["branch_type"].toInt());
    c10::cuda::CUDAGuard on_device(sum.device());
    auto dsum = grads[0].defined() ? grads[0].to(torch::kFloat32).contiguous() : torch::Tensor();
    // No gradient for the normed output (unused): only the residual stream's passes through.
    auto dnormed = grads[1].defined() ? grads[1].to(branch_type).contiguous()
                                      : torch::zeros(sum.sizes(), sum.options().dtype(branch_type));
    const int64_t rows = sum.numel() / sum.size(-1);
    auto dx = torch::empty_like(sum);
    auto dbranch = torch::empty(sum.sizes(), sum.options().dtype(branch_type));
    LayerNormParamGrads param_grads;
    auto a = layer_norm_backward_args(sum, dnormed, stats, weight, dx, param_grads);
    a.dsum = dsum.defined() ? dsum.data_ptr<float>() : nullptr;
    a.dbranch = dbranch.data_ptr();
    a.scale = scale.numel() > 0 ? scale.data_ptr<float>() : nullptr;
    a.rows_per_sample = rows / sum.size(0);
    const auto err = kernels::layer_norm_backward(a, stream_of(sum));
    if (err != cudaSuccess) {
      fail("residual add + layer norm backward (cuda): {}", cudaGetErrorString(err));
    }
    return {dx, dbranch, param_grads.dweight, param_grads.dbias, torch::Tensor(), torch::Tensor()};
  }
};
#endif

ResidualNorm separate_ops(const torch::Tensor& x, const torch::Tensor& branch,
                          const torch::Tensor& scale, LayerNormImpl& norm) {
  auto sum = residual_add_reference(x, branch, scale);
  return {sum, norm.forward(sum)};
}

void check_shapes(const torch::Tensor& x, const torch::Tensor& branch, const LayerNormImpl& norm) {
  if (x.dim() == 0 || x.sizes() != branch.sizes()) {
    fail("residual add + norm: shapes {} and {} differ", c10::str(x.sizes()),
         c10::str(branch.sizes()));
  }
  if (x.size(-1) != norm.dim()) {
    fail("residual add + norm: input's last dimension is {}, the norm normalizes {}", x.size(-1),
         norm.dim());
  }
}

}  // namespace

ResidualNorm residual_add_norm_with_scale(const torch::Tensor& x, const torch::Tensor& branch,
                                          const torch::Tensor& scale, LayerNormImpl& norm) {
  check_shapes(x, branch, norm);
#ifdef MHLA_WITH_CUDA_KERNELS
  if (uses_kernel(x, branch, norm)) {
    auto none = torch::empty({0}, x.options().dtype(torch::kFloat32));
    auto out = ResidualNormFunction::apply(x, branch, norm.weight.defined() ? norm.weight : none,
                                           norm.bias.defined() ? norm.bias : none,
                                           scale.defined() ? scale : none, norm.eps());
    return {out[0], out[1]};
  }
#endif
  return separate_ops(x, branch, scale, norm);
}

ResidualNorm residual_add_norm(const torch::Tensor& x, const torch::Tensor& branch,
                               double drop_rate, bool training, LayerNormImpl& norm) {
  check_shapes(x, branch, norm);
#ifdef MHLA_WITH_CUDA_KERNELS
  if (uses_kernel(x, branch, norm)) {
    // The same draw residual_add would make, so the fused and separate paths train alike.
    auto scale = drop_path_scale(x.size(0), drop_rate, training, x.device());
    return residual_add_norm_with_scale(x, branch, scale, norm);
  }
#endif
  auto sum = residual_add(x, branch, drop_rate, training);
  return {sum, norm.forward(sum)};
}

}  // namespace mhla
