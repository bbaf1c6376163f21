#include "attention/short_conv.h"

#include "core/environment.h"
#include "core/error.h"

#ifdef MHLA_WITH_CUDA_KERNELS
#include <c10/cuda/CUDAGuard.h>

#include "core/cuda_stream.h"
#include "core/kernel_dtype.h"
#include "short_conv/short_conv.h"
#endif

namespace mhla {
namespace {

constexpr double kNormEps = 1e-6;

void check_shapes(const torch::Tensor& qkv, const torch::Tensor& weight, int64_t heads) {
  if (qkv.dim() != 3 || heads <= 0 || qkv.size(2) % (3 * heads) != 0 || weight.dim() != 3 ||
      weight.size(0) != qkv.size(2) || weight.size(1) != 1) {
    fail("short conv: qkv {} (want [B, T, 3 H D]), weight {} (want [3 H D, 1, W]) and {} heads "
         "do not match",
         c10::str(qkv.sizes()), c10::str(weight.sizes()), heads);
  }
}

#ifdef MHLA_WITH_CUDA_KERNELS
namespace kernels = mhla_kernels;
using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;

kernels::ShortConvArgs args_for(const torch::Tensor& qkv, const torch::Tensor& weight,
                                int64_t heads, bool reversed) {
  kernels::ShortConvArgs a;
  a.dtype = *kernel_dtype_of(qkv.scalar_type());
  a.batch = static_cast<int>(qkv.size(0)), a.tokens = static_cast<int>(qkv.size(1));
  a.heads = static_cast<int>(heads);
  a.head_dim = static_cast<int>(qkv.size(2) / (3 * heads));
  a.reversed = reversed;
  a.eps = static_cast<float>(kNormEps);
  a.x = qkv.data_ptr(), a.weight = weight.data_ptr<float>();
  return a;
}

class ShortConvFunction : public torch::autograd::Function<ShortConvFunction> {
 public:
  static tensor_list forward(AutogradContext* ctx, const torch::Tensor& qkv_in,
                             const torch::Tensor& weight_in, int64_t heads, bool reversed) {
    c10::cuda::CUDAGuard on_device(qkv_in.device());
    auto qkv = qkv_in.contiguous(), weight = weight_in.contiguous();
    auto a = args_for(qkv, weight, heads, reversed);
    auto q = torch::empty({qkv.size(0), qkv.size(1), heads, a.head_dim}, qkv.options());
    auto k = torch::empty_like(q), v = torch::empty_like(q);
    a.q = q.data_ptr(), a.k = k.data_ptr(), a.v = v.data_ptr();
    const auto err = kernels::short_conv_forward(a, stream_of(qkv));
    if (err != cudaSuccess) fail("short conv (cuda): {}", cudaGetErrorString(err));
    ctx->save_for_backward({qkv, weight});
    ctx->saved_data["heads"] = heads;
    ctx->saved_data["reversed"] = reversed;
    return {q, k, v};
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &qkv = saved[0], &weight = saved[1];
    c10::cuda::CUDAGuard on_device(qkv.device());
    const auto heads = ctx->saved_data["heads"].toInt();
    auto a = args_for(qkv, weight, heads, ctx->saved_data["reversed"].toBool());
    const auto shape = std::vector<int64_t>{qkv.size(0), qkv.size(1), heads, a.head_dim};
    auto grad = [&](const torch::Tensor& g) {
      return g.defined() ? g.to(qkv.scalar_type()).contiguous() : torch::zeros(shape, qkv.options());
    };
    auto dq = grad(grads[0]), dk = grad(grads[1]), dv = grad(grads[2]);
    auto dx = torch::empty_like(qkv);
    auto f32 = qkv.options().dtype(torch::kFloat32);
    auto dweight = torch::empty(weight.sizes(), f32);
    auto workspace =
        torch::empty({static_cast<int64_t>(kernels::short_conv_workspace_floats(a))}, f32);
    a.dq = dq.data_ptr(), a.dk = dk.data_ptr(), a.dv = dv.data_ptr();
    a.dx = dx.data_ptr(), a.dweight = dweight.data_ptr<float>();
    a.workspace = workspace.data_ptr<float>();
    const auto err = kernels::short_conv_backward(a, stream_of(qkv));
    if (err != cudaSuccess) fail("short conv backward (cuda): {}", cudaGetErrorString(err));
    return {dx, dweight, torch::Tensor(), torch::Tensor()};
  }
};

bool kernel_takes(const torch::Tensor& qkv, const torch::Tensor& weight, int64_t heads) {
  return qkv.is_cuda() && kernel_dtype_of(qkv.scalar_type()).has_value() &&
         weight.scalar_type() == torch::kFloat32 && weight.device() == qkv.device() &&
         qkv.size(0) <= INT32_MAX && qkv.size(1) <= INT32_MAX &&
         kernels::short_conv_supports(static_cast<int>(qkv.size(2) / (3 * heads)),
                                      static_cast<int>(weight.size(2)));
}
#endif

}  // namespace

std::array<torch::Tensor, 3> activate_conv_qkv(const torch::Tensor& conv_out, int64_t heads) {
  const auto b = conv_out.size(0), n = conv_out.size(1), dim = conv_out.size(2) / 3;
  auto parts = torch::silu(conv_out).split(dim, -1);
  auto l2 = torch::nn::functional::NormalizeFuncOptions().dim(-1).eps(kNormEps);
  auto q = torch::nn::functional::normalize(parts[0].reshape({b, n, heads, dim / heads}), l2);
  auto k = torch::nn::functional::normalize(parts[1].reshape({b, n, heads, dim / heads}), l2);
  return {q, k, parts[2].reshape({b, n, heads, dim / heads})};
}

std::array<torch::Tensor, 3> short_conv_qkv_reference(const torch::Tensor& qkv,
                                                      const torch::Tensor& weight, int64_t heads,
                                                      bool reversed) {
  check_shapes(qkv, weight, heads);
  const auto width = weight.size(2);
  auto x = reversed ? qkv.flip({1}) : qkv;
  // Depthwise (one group per channel), padded on the left only: causal over time.
  auto padded = torch::constant_pad_nd(x.transpose(1, 2), {width - 1, 0}, 0.0);
  auto conv = torch::nn::functional::conv1d(
      padded, weight.to(padded.scalar_type()),
      torch::nn::functional::Conv1dFuncOptions().groups(qkv.size(2)));
  return activate_conv_qkv(conv.transpose(1, 2), heads);
}

std::array<torch::Tensor, 3> short_conv_qkv_kernel(const torch::Tensor& qkv,
                                                   const torch::Tensor& weight, int64_t heads,
                                                   bool reversed) {
  check_shapes(qkv, weight, heads);
#ifdef MHLA_WITH_CUDA_KERNELS
  if (!kernel_takes(qkv, weight, heads)) {
    fail("short conv kernel: needs qkv on CUDA in one of fp32/bf16/fp16, an fp32 weight on the "
         "same device of width 4 and a head dim of 32, 64 or 128 (got {} {}, weight {} of width "
         "{}, head dim {})",
         c10::toString(qkv.scalar_type()), qkv.device().str(),
         c10::toString(weight.scalar_type()), weight.size(2), qkv.size(2) / (3 * heads));
  }
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  auto outs = ShortConvFunction::apply(qkv, weight, heads, reversed);
  return {outs[0], outs[1], outs[2]};
#else
  fail("short conv kernel: this build has no CUDA kernels");
#endif
}

std::array<torch::Tensor, 3> short_conv_qkv(const torch::Tensor& qkv, const torch::Tensor& weight,
                                            int64_t heads, bool reversed) {
#ifdef MHLA_WITH_CUDA_KERNELS
  static const bool enabled = environment_switch("MHLA_FUSED_SHORT_CONV", true);
  check_shapes(qkv, weight, heads);
  if (enabled && kernel_takes(qkv, weight, heads)) {
    return short_conv_qkv_kernel(qkv, weight, heads, reversed);
  }
#endif
  return short_conv_qkv_reference(qkv, weight, heads, reversed);
}

}  // namespace mhla
