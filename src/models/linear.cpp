#include "models/linear.h"

#include <ATen/autocast_mode.h>

#include "core/environment.h"
#include "core/error.h"

#ifdef MHLA_WITH_CUDA_KERNELS
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "column_sum/column_sum.h"
#include "core/kernel_dtype.h"
#endif

namespace mhla {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;

bool bias_kernel_enabled() {
  static const bool enabled = environment_switch("MHLA_LINEAR_BIAS_KERNEL", true);
  return enabled;
}

}  // namespace

torch::ScalarType linear_compute_dtype(const torch::Tensor& x) {
  const auto device_type = x.device().type();
  if (at::autocast::is_autocast_enabled(device_type) && x.is_floating_point() &&
      x.scalar_type() != torch::kFloat64) {
    return at::autocast::get_autocast_dtype(device_type);
  }
  return x.scalar_type();
}

void column_sums_into(const torch::Tensor& grad, const torch::Tensor& out) {
  if (grad.dim() != 2 || out.dim() != 1 || out.size(0) != grad.size(1) || !out.is_contiguous() ||
      out.device() != grad.device() ||
      out.scalar_type() !=
          (grad.scalar_type() == torch::kFloat64 ? torch::kFloat64 : torch::kFloat32)) {
    fail(
        "column sums: need a [rows, cols] input and a contiguous fp32 (fp64 for fp64) [cols] "
        "output beside it; got {} {} into {} {}",
        c10::toString(grad.scalar_type()), c10::str(grad.sizes()), c10::toString(out.scalar_type()),
        c10::str(out.sizes()));
  }
#ifdef MHLA_WITH_CUDA_KERNELS
  if (grad.is_cuda() && kernel_dtype_of(grad.scalar_type())) {
    namespace kernels = mhla_kernels;
    c10::cuda::CUDAGuard on_device(grad.device());
    auto g = grad.contiguous();
    const int64_t rows = g.size(0), cols = g.size(1);
    auto workspace = torch::empty(
        {static_cast<int64_t>(kernels::column_sum_workspace_floats(rows, static_cast<int>(cols)))},
        out.options());
    kernels::ColumnSumArgs a;
    a.dtype = *kernel_dtype_of(g.scalar_type());
    a.rows = rows, a.cols = static_cast<int>(cols);
    a.x = g.data_ptr(), a.out = out.data_ptr<float>(), a.workspace = workspace.data_ptr<float>();
    const auto err =
        kernels::column_sum(a, c10::cuda::getCurrentCUDAStream(g.device().index()).stream());
    if (err != cudaSuccess) fail("column sums (cuda): {}", cudaGetErrorString(err));
    return;
  }
#endif
  auto target = out;  // sum_out takes a non-const reference
  torch::sum_out(target, grad, {0}, /*keepdim=*/false, out.scalar_type());
}

torch::Tensor column_sums(const torch::Tensor& grad) {
  const auto accumulate = grad.scalar_type() == torch::kFloat64 ? torch::kFloat64 : torch::kFloat32;
  auto out = torch::empty({grad.size(1)}, grad.options().dtype(accumulate));
  column_sums_into(grad, out);
  return out;
}

namespace {

// Autocast's casts done by hand (the function's forward runs with autocast excluded, so nothing
// is cast twice): the bf16/fp16 copies of x and W it multiplies are the ones the backward uses.
class LinearFunction : public torch::autograd::Function<LinearFunction> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& weight, const torch::Tensor& bias) {
    const auto compute = linear_compute_dtype(x);
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    auto xc = x.to(compute), wc = weight.to(compute);
    auto out = torch::linear(xc, wc, bias.to(compute));
    ctx->save_for_backward({xc, wc});
    ctx->saved_data["x_type"] = static_cast<int64_t>(x.scalar_type());
    ctx->saved_data["w_type"] = static_cast<int64_t>(weight.scalar_type());
    ctx->saved_data["b_type"] = static_cast<int64_t>(bias.scalar_type());
    return out;
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto& xc = saved[0];
    const auto& wc = saved[1];
    auto type = [&](const char* key) {
      return static_cast<torch::ScalarType>(ctx->saved_data[key].toInt());
    };
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    const int64_t out_features = wc.size(0), in_features = wc.size(1);
    auto dy = grads[0].to(wc.scalar_type()).reshape({-1, out_features}).contiguous();
    auto x2 = xc.reshape({-1, in_features});
    // Only the gradients autograd asks for (the first layer's input usually needs none).
    torch::Tensor dx, dw, db;
    if (ctx->needs_input_grad(0)) dx = dy.mm(wc).view(xc.sizes()).to(type("x_type"));
    if (ctx->needs_input_grad(1)) dw = dy.t().mm(x2).to(type("w_type"));
    if (ctx->needs_input_grad(2)) db = column_sums(dy).to(type("b_type"));
    return {dx, dw, db};
  }
};

}  // namespace

torch::Tensor linear_with_own_backward(const torch::Tensor& x, const torch::Tensor& weight,
                                       const torch::Tensor& bias) {
  if (!bias.defined() || x.dim() < 1 || weight.dim() != 2 || x.size(-1) != weight.size(1)) {
    fail("linear: input [..., {}] against weight [{}, {}] and {} bias", x.dim() ? x.size(-1) : 0,
         weight.dim() == 2 ? weight.size(0) : 0, weight.dim() == 2 ? weight.size(1) : 0,
         bias.defined() ? "a" : "no");
  }
  return LinearFunction::apply(x, weight, bias);
}

torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& weight,
                     const torch::Tensor& bias) {
  if (bias_kernel_enabled() && bias.defined() && x.is_cuda() && x.dim() >= 2 &&
      x.is_floating_point() && x.scalar_type() != torch::kFloat64 &&
      torch::GradMode::is_enabled() &&
      (x.requires_grad() || weight.requires_grad() || bias.requires_grad())) {
    return linear_with_own_backward(x, weight, bias);
  }
  return torch::linear(x, weight, bias);
}

}  // namespace mhla
