#include "attention/gated_rms_norm.h"

#include "core/environment.h"
#include "core/error.h"

#ifdef MHLA_WITH_CUDA_KERNELS
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "core/cuda_stream.h"
#include "core/kernel_dtype.h"
#include "gated_rms_norm/gated_rms_norm.h"
#endif

namespace mhla {
namespace {

void check_shapes(const torch::Tensor& x, const torch::Tensor& gate, const torch::Tensor& weight) {
  if (x.dim() == 0 || gate.sizes() != x.sizes() || weight.dim() != 1 ||
      weight.size(0) != x.size(-1)) {
    fail("gated RMSNorm: x {}, gate {} and weight {} do not match", c10::str(x.sizes()),
         c10::str(gate.sizes()), c10::str(weight.sizes()));
  }
}

#ifdef MHLA_WITH_CUDA_KERNELS
namespace kernels = mhla_kernels;
using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;

kernels::GatedRmsNormArgs args_for(const torch::Tensor& x, const torch::Tensor& gate,
                                   const torch::Tensor& weight, const torch::Tensor& rstd,
                                   double eps) {
  kernels::GatedRmsNormArgs a;
  a.dtype = *kernel_dtype_of(x.scalar_type());
  a.dim = static_cast<int>(x.size(-1));
  a.vectors = x.numel() / a.dim;
  a.eps = static_cast<float>(eps);
  a.x = x.data_ptr(), a.gate = gate.data_ptr(), a.weight = weight.data_ptr<float>();
  a.rstd = rstd.data_ptr<float>();
  return a;
}

class GatedRmsNormFunction : public torch::autograd::Function<GatedRmsNormFunction> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x_in,
                               const torch::Tensor& gate_in, const torch::Tensor& weight,
                               double eps) {
    c10::cuda::CUDAGuard on_device(x_in.device());
    auto x = x_in.contiguous(), gate = gate_in.contiguous();
    auto rstd = torch::empty({x.numel() / x.size(-1)}, x.options().dtype(torch::kFloat32));
    auto y = torch::empty_like(x);
    auto a = args_for(x, gate, weight, rstd, eps);
    a.y = y.data_ptr();
    const auto err = kernels::gated_rms_norm_forward(a, stream_of(x));
    if (err != cudaSuccess) fail("gated RMSNorm (cuda): {}", cudaGetErrorString(err));
    ctx->save_for_backward({x, gate, weight, rstd});
    ctx->saved_data["eps"] = eps;
    return y;
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &x = saved[0], &gate = saved[1], &weight = saved[2], &rstd = saved[3];
    c10::cuda::CUDAGuard on_device(x.device());
    auto dy = grads[0].to(x.scalar_type()).contiguous();
    auto dx = torch::empty_like(x), dgate = torch::empty_like(gate);
    const int dim = static_cast<int>(x.size(-1));
    auto f32 = x.options().dtype(torch::kFloat32);
    auto dweight = torch::empty({dim}, f32);
    auto workspace = torch::empty(
        {static_cast<int64_t>(kernels::gated_rms_norm_workspace_floats(x.numel() / dim, dim))}, f32);
    auto a = args_for(x, gate, weight, rstd, ctx->saved_data["eps"].toDouble());
    a.dy = dy.data_ptr(), a.dx = dx.data_ptr(), a.dgate = dgate.data_ptr();
    a.dweight = dweight.data_ptr<float>(), a.workspace = workspace.data_ptr<float>();
    const auto err = kernels::gated_rms_norm_backward(a, stream_of(x));
    if (err != cudaSuccess) fail("gated RMSNorm backward (cuda): {}", cudaGetErrorString(err));
    return {dx, dgate, dweight, torch::Tensor()};
  }
};

bool kernel_takes(const torch::Tensor& x, const torch::Tensor& gate, const torch::Tensor& weight) {
  return x.is_cuda() && kernel_dtype_of(x.scalar_type()).has_value() &&
         gate.scalar_type() == x.scalar_type() && gate.device() == x.device() &&
         weight.scalar_type() == torch::kFloat32 && weight.device() == x.device() &&
         weight.is_contiguous() &&
         kernels::gated_rms_norm_supports(static_cast<int>(x.size(-1)));
}
#endif

}  // namespace

torch::Tensor gated_rms_norm_reference(const torch::Tensor& x, const torch::Tensor& gate,
                                       const torch::Tensor& weight, double eps) {
  check_shapes(x, gate, weight);
  return at::rms_norm(x, {x.size(-1)}, weight, eps) * torch::silu(gate);
}

torch::Tensor gated_rms_norm_kernel(const torch::Tensor& x, const torch::Tensor& gate,
                                    const torch::Tensor& weight, double eps) {
  check_shapes(x, gate, weight);
#ifdef MHLA_WITH_CUDA_KERNELS
  if (!kernel_takes(x, gate, weight)) {
    fail("gated RMSNorm kernel: needs x and gate on CUDA in one of fp32/bf16/fp16, an fp32 "
         "weight and a last dimension of 32, 64, 128 or 256 (got {} {} [{}])",
         c10::toString(x.scalar_type()), x.device().str(), x.size(-1));
  }
  return GatedRmsNormFunction::apply(x, gate, weight, eps);
#else
  fail("gated RMSNorm kernel: this build has no CUDA kernels");
#endif
}

torch::Tensor gated_rms_norm(const torch::Tensor& x, const torch::Tensor& gate,
                             const torch::Tensor& weight, double eps) {
#ifdef MHLA_WITH_CUDA_KERNELS
  static const bool enabled = environment_switch("MHLA_FUSED_GATED_NORM", true);
  if (enabled && x.dim() > 0 && gate.sizes() == x.sizes() && kernel_takes(x, gate, weight)) {
    return gated_rms_norm_kernel(x, gate, weight, eps);
  }
#endif
  return gated_rms_norm_reference(x, gate, weight, eps);
}

}  // namespace mhla
