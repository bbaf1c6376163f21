#include "models/adaln.h"

#include "core/environment.h"
#include "core/error.h"

#ifdef MHLA_WITH_CUDA_KERNELS
#include <c10/cuda/CUDAGuard.h>

#include "adaln/adaln.h"
#include "core/cuda_stream.h"
#include "core/kernel_dtype.h"
#include "models/layer_norm_launch.h"
#endif

namespace mhla {
namespace {

#ifdef MHLA_WITH_CUDA_KERNELS
namespace kernels = mhla_kernels;
using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;

bool fused_adaln_enabled() {
  static const bool enabled = environment_switch("MHLA_FUSED_ADALN", true);
  return enabled;
}

bool is_sample_vector(const torch::Tensor& v, const torch::Tensor& x) {
  return v.defined() && v.dim() == 2 && v.size(0) == x.size(0) && v.size(1) == x.size(2) &&
         v.device() == x.device() && v.is_floating_point();
}

bool uses_kernel(const torch::Tensor& x, const torch::Tensor& branch, const torch::Tensor& gate,
                 const torch::Tensor& shift, const torch::Tensor& scale,
                 const LayerNormImpl& norm) {
  if (!fused_adaln_enabled() || norm.weight.defined() || norm.bias.defined() ||
      !layer_norm_uses_kernel(x, norm.weight) || x.scalar_type() != torch::kFloat32 ||
      x.dim() != 3 || x.numel() == 0 || x.size(0) > 65535 ||
      x.size(2) > kernels::kAdaLnMaxColumns) {
    return false;
  }
  if (!is_sample_vector(shift, x) || !is_sample_vector(scale, x)) return false;
  if (!branch.defined()) return true;
  return branch.sizes() == x.sizes() && branch.device() == x.device() &&
         branch.scalar_type() == layer_norm_output_type(x) &&
         (!gate.defined() || is_sample_vector(gate, x));
}

// fp32 with unit column stride (the modulation's chunks keep their row stride).
torch::Tensor as_sample_vectors(const torch::Tensor& v) {
  auto f = v.to(torch::kFloat32);
  return f.stride(1) == 1 && f.stride(0) % 4 == 0 ? f : f.contiguous();
}

kernels::SampleVectors view_of(const torch::Tensor& v) {
  if (v.numel() == 0) return {};
  return {v.data_ptr<float>(), v.stride(0)};
}

// Absent tensors arrive as 0-element ones (a custom Function's tensor arguments must be
// defined). Outputs: {sum, normed} with a branch, {normed} without.
class AdaLnFunction : public torch::autograd::Function<AdaLnFunction> {
 public:
  static tensor_list forward(AutogradContext* ctx, const torch::Tensor& x,
                             const torch::Tensor& branch, const torch::Tensor& gate,
                             const torch::Tensor& shift, const torch::Tensor& scale, double eps,
                             torch::ScalarType out_type) {
    c10::cuda::CUDAGuard on_device(x.device());
    const bool residual = branch.numel() > 0;
    auto xc = x.contiguous();
    auto bc = residual ? branch.contiguous() : branch;
    const int64_t samples = xc.size(0), per_sample = xc.size(1), cols = xc.size(2);
    auto sum = residual ? torch::empty_like(xc) : xc;
    auto normed = torch::empty(xc.sizes(), xc.options().dtype(out_type));
    auto stats = torch::empty({2, samples * per_sample}, xc.options());
    kernels::AdaLnForwardArgs a;
    a.dtype = *kernel_dtype_of(out_type);
    a.samples = samples, a.rows_per_sample = per_sample, a.cols = static_cast<int>(cols);
    a.eps = static_cast<float>(eps);
    a.x = xc.data_ptr<float>();
    a.branch = residual ? bc.data_ptr() : nullptr;
    a.gate = view_of(gate), a.shift = view_of(shift), a.scale = view_of(scale);
    a.sum = residual ? sum.data_ptr<float>() : nullptr;
    a.normed = normed.data_ptr();
    a.mean = stats[0].data_ptr<float>(), a.rstd = stats[1].data_ptr<float>();
    const auto err = kernels::adaln_forward(a, stream_of(xc));
    if (err != cudaSuccess) fail("adaLN hinge (cuda): {}", cudaGetErrorString(err));
    ctx->save_for_backward({sum, stats, bc, gate, scale});
    ctx->saved_data["out_type"] = static_cast<int64_t>(out_type);
    if (residual) return {sum, normed};
    return {normed};
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto& sum = saved[0];
    const auto& stats = saved[1];
    const auto& branch = saved[2];
    const auto& gate = saved[3];
    const auto& scale = saved[4];
    const auto out_type = static_cast<torch::ScalarType>(ctx->saved_data["out_type"].toInt());
    const bool residual = branch.numel() > 0;
    c10::cuda::CUDAGuard on_device(sum.device());
    const auto& normed_grad = grads[residual ? 1 : 0];
    auto dsum = residual && grads[0].defined() ? grads[0].to(torch::kFloat32).contiguous()
                                               : torch::Tensor();
    auto dnormed = normed_grad.defined() ? normed_grad.to(out_type).contiguous()
                                         : torch::zeros(sum.sizes(), sum.options().dtype(out_type));
    const int64_t samples = sum.size(0), per_sample = sum.size(1), cols = sum.size(2);
    auto dx = torch::empty_like(sum);
    auto dbranch = residual ? torch::empty_like(branch) : torch::Tensor();
    auto dmodulation = torch::empty({samples, 3, cols}, sum.options());
    auto workspace = torch::empty({static_cast<int64_t>(kernels::adaln_backward_workspace_floats(
                                      samples, per_sample, static_cast<int>(cols)))},
                                  sum.options());
    kernels::AdaLnBackwardArgs a;
    a.dtype = *kernel_dtype_of(out_type);
    a.samples = samples, a.rows_per_sample = per_sample, a.cols = static_cast<int>(cols);
    a.sum = sum.data_ptr<float>();
    a.dnormed = dnormed.data_ptr();
    a.mean = stats[0].data_ptr<float>(), a.rstd = stats[1].data_ptr<float>();
    a.scale = view_of(scale);
    a.dsum = dsum.defined() ? dsum.data_ptr<float>() : nullptr;
    a.branch = residual ? branch.data_ptr() : nullptr;
    a.gate = view_of(gate);
    a.dx = dx.data_ptr<float>();
    a.dbranch = residual ? dbranch.data_ptr() : nullptr;
    a.dmodulation = dmodulation.data_ptr<float>();
    a.workspace = workspace.data_ptr<float>();
    const auto err = kernels::adaln_backward(a, stream_of(sum));
    if (err != cudaSuccess) fail("adaLN hinge backward (cuda): {}", cudaGetErrorString(err));
    const bool gated = residual && gate.numel() > 0;
    return {dx,
            dbranch,
            gated ? dmodulation.select(1, 2) : torch::Tensor(),
            dmodulation.select(1, 0),
            dmodulation.select(1, 1),
            torch::Tensor(),
            torch::Tensor()};
  }
};
#endif

void check_shapes(const torch::Tensor& x, const torch::Tensor& branch, const torch::Tensor& gate,
                  const torch::Tensor& shift, const torch::Tensor& scale,
                  const LayerNormImpl& norm) {
  if (x.dim() != 3) fail("adaLN hinge: expected tokens [B, N, C], got {}", c10::str(x.sizes()));
  if (x.size(2) != norm.dim()) {
    fail("adaLN hinge: tokens have {} channels, the norm normalizes {}", x.size(2), norm.dim());
  }
  if (branch.defined() && branch.sizes() != x.sizes()) {
    fail("adaLN hinge: branch {} differs from the residual stream {}", c10::str(branch.sizes()),
         c10::str(x.sizes()));
  }
  const std::vector<int64_t> expected{x.size(0), x.size(2)};
  for (const auto* v : {&shift, &scale, &gate}) {
    if (v == &gate && !v->defined()) continue;
    if (!v->defined() || v->sizes() != c10::IntArrayRef(expected)) {
      fail("adaLN hinge: per-sample vectors must be [{}, {}], got {}", x.size(0), x.size(2),
           v->defined() ? c10::str(v->sizes()) : std::string("none"));
    }
  }
}

}  // namespace

torch::Tensor adaln_modulation(const torch::Tensor& modulation) {
#ifdef MHLA_WITH_CUDA_KERNELS
  // Where the norm kernels are off (MHLA_FUSED_NORM=0) the hinge takes the torch ops: keep the
  // autocast dtype there, as those ops expect.
  if (fused_adaln_enabled() && norm_kernels_enabled() && modulation.is_cuda()) {
    return modulation.to(torch::kFloat32);
  }
#endif
  return modulation;
}

torch::Tensor modulate(const torch::Tensor& x, const torch::Tensor& shift,
                       const torch::Tensor& scale) {
  return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1);
}

AdaLnHinge adaln_hinge_reference(const torch::Tensor& x, const torch::Tensor& branch,
                                 const torch::Tensor& gate, const torch::Tensor& shift,
                                 const torch::Tensor& scale, LayerNormImpl& norm) {
  check_shapes(x, branch, gate, shift, scale, norm);
  torch::Tensor sum = x;
  if (branch.defined()) sum = gate.defined() ? x + gate.unsqueeze(1) * branch : x + branch;
  return {sum, modulate(norm.forward(sum), shift, scale)};
}

AdaLnHinge adaln_hinge(const torch::Tensor& x, const torch::Tensor& branch,
                       const torch::Tensor& gate, const torch::Tensor& shift,
                       const torch::Tensor& scale, LayerNormImpl& norm) {
  check_shapes(x, branch, gate, shift, scale, norm);
#ifdef MHLA_WITH_CUDA_KERNELS
  if (uses_kernel(x, branch, gate, shift, scale, norm)) {
    auto none = torch::empty({0}, x.options());
    const bool residual = branch.defined();
    auto out = AdaLnFunction::apply(x, residual ? branch : none.to(layer_norm_output_type(x)),
                                    residual && gate.defined() ? as_sample_vectors(gate) : none,
                                    as_sample_vectors(shift), as_sample_vectors(scale), norm.eps(),
                                    layer_norm_output_type(x));
    if (residual) return {out[0], out[1]};
    return {x, out[0]};
  }
#endif
  return adaln_hinge_reference(x, branch, gate, shift, scale, norm);
}

}  // namespace mhla
