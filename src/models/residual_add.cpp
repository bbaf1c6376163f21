#include "models/residual_add.h"

#include "core/error.h"
#include "models/layer_norm.h"

#ifdef MHLA_WITH_CUDA_KERNELS
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "core/kernel_dtype.h"
#include "residual_add/residual_add.h"
#endif

namespace mhla {
namespace {

#ifdef MHLA_WITH_CUDA_KERNELS
namespace kernels = mhla_kernels;
using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;

bool uses_kernel(const torch::Tensor& x, const torch::Tensor& branch) {
  return norm_kernels_enabled() && x.is_cuda() && x.scalar_type() == torch::kFloat32 &&
         branch.device() == x.device() && branch.sizes() == x.sizes() && x.dim() >= 1 &&
         kernel_dtype_of(branch.scalar_type()).has_value();
}

// `scale` is a 0-element tensor when nothing is dropped (a custom Function's tensor arguments
// must be defined).
class ResidualAddFunction : public torch::autograd::Function<ResidualAddFunction> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& branch, const torch::Tensor& scale) {
    c10::cuda::CUDAGuard on_device(x.device());
    auto xc = x.contiguous(), bc = branch.contiguous();
    auto out = torch::empty_like(xc);
    kernels::ResidualAddArgs a;
    a.branch_dtype = *kernel_dtype_of(bc.scalar_type());
    a.numel = xc.numel();
    a.per_sample = xc.numel() / xc.size(0);
    a.x = xc.data_ptr<float>(), a.branch = bc.data_ptr();
    a.scale = scale.numel() > 0 ? scale.data_ptr<float>() : nullptr;
    a.out = out.data_ptr<float>();
    const auto err =
        kernels::residual_add(a, c10::cuda::getCurrentCUDAStream(x.device().index()).stream());
    if (err != cudaSuccess) fail("residual add (cuda): {}", cudaGetErrorString(err));
    ctx->save_for_backward({scale});
    ctx->saved_data["branch_type"] = static_cast<int64_t>(bc.scalar_type());
    return out;
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    const auto scale = ctx->get_saved_variables()[0];
    const auto branch_type = static_cast<torch::ScalarType>(ctx->saved_data["branch_type"].toInt());
    auto dout = grads[0].contiguous();
    c10::cuda::CUDAGuard on_device(dout.device());
    auto dbranch = torch::empty(dout.sizes(), dout.options().dtype(branch_type));
    kernels::ScaledCastArgs a;
    a.out_dtype = *kernel_dtype_of(branch_type);
    a.numel = dout.numel();
    a.per_sample = dout.numel() / dout.size(0);
    a.grad = dout.data_ptr<float>();
    a.scale = scale.numel() > 0 ? scale.data_ptr<float>() : nullptr;
    a.out = dbranch.data_ptr();
    const auto err =
        kernels::scaled_cast(a, c10::cuda::getCurrentCUDAStream(dout.device().index()).stream());
    if (err != cudaSuccess) fail("residual add backward (cuda): {}", cudaGetErrorString(err));
    return {dout, dbranch, torch::Tensor()};
  }
};
#endif

}  // namespace

torch::Tensor drop_path_scale(int64_t batch, double drop_rate, bool training,
                              const torch::Device& device) {
  if (!training || drop_rate <= 0.0) return {};
  const double keep = 1.0 - drop_rate;
  auto f32 = torch::TensorOptions().dtype(torch::kFloat32).device(device);
  return torch::rand({batch}, f32).lt(keep).to(torch::kFloat32) / keep;
}

torch::Tensor residual_add_reference(const torch::Tensor& x, const torch::Tensor& branch,
                                     const torch::Tensor& scale) {
  if (!scale.defined()) return x + branch;
  std::vector<int64_t> shape(branch.dim(), 1);
  shape[0] = branch.size(0);
  return x + branch * scale.view(shape).to(x.scalar_type());
}

torch::Tensor residual_add(const torch::Tensor& x, const torch::Tensor& branch, double drop_rate,
                           bool training) {
  if (x.dim() == 0 || x.sizes() != branch.sizes()) {
    fail("residual add: shapes {} and {} differ", c10::str(x.sizes()), c10::str(branch.sizes()));
  }
  auto scale = drop_path_scale(x.size(0), drop_rate, training, x.device());
#ifdef MHLA_WITH_CUDA_KERNELS
  if (uses_kernel(x, branch)) {
    return ResidualAddFunction::apply(
        x, branch, scale.defined() ? scale : torch::empty({0}, x.options().dtype(torch::kFloat32)));
  }
#endif
  return residual_add_reference(x, branch, scale);
}

}  // namespace mhla
