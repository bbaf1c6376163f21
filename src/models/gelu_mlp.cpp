#include "models/gelu_mlp.h"

#include <cstdlib>
#include <string>
#include <utility>

#include "core/environment.h"
#include "core/error.h"
#include "models/linear.h"

#ifdef MHLA_WITH_CUDA_KERNELS
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "column_sum/column_sum.h"
#include "core/kernel_dtype.h"
#include "gemm_epilogue/gelu_gemm.h"
#endif

namespace mhla {
namespace {

#ifdef MHLA_WITH_CUDA_KERNELS
using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;
namespace kernels = mhla_kernels;

bool fused_mlp_enabled() {
  static const bool enabled = environment_switch("MHLA_FUSED_MLP", true);
  return enabled;
}

// How the backward forms d_pre = (dy W2) gelu'(pre) and d_b1 (MHLA_FUSED_MLP_BACKWARD):
//   epilogue  cuBLASLt's DGELU epilogue on the product, then the fp32 column sums of d_pre;
//             the default (DiT-S at 1,024 tokens: 1.4 % more images/s than `kernel`).
//   kernel    dy W2 by torch, then one pass of kernels/column_sum that writes d_pre and sums it
//             (fp32 bias gradient).
//   bgrad     cuBLASLt's DGELU_BGRAD epilogue (d_b1 in the compute dtype): on the H200 it ran as
//             a separate generic epilogue kernel, 3 ms per layer of DiT-S at 1,024 tokens.
enum class BackwardForm { kernel, epilogue, bgrad };
BackwardForm backward_form() {
  static const BackwardForm form = [] {
    const char* value = std::getenv("MHLA_FUSED_MLP_BACKWARD");
    if (value == nullptr || std::string(value) == "epilogue") return BackwardForm::epilogue;
    if (std::string(value) == "kernel") return BackwardForm::kernel;
    if (std::string(value) == "bgrad") return BackwardForm::bgrad;
    fail("MHLA_FUSED_MLP_BACKWARD = '{}': expected kernel, epilogue or bgrad", value);
  }();
  return form;
}

// The cuBLASLt handle of the current stream's device and a workspace from the caching allocator
// (kept alive by the returned tensor until the products are queued).
struct ProductContext {
  torch::Tensor workspace;
  kernels::EpilogueContext context;
  explicit ProductContext(const torch::Tensor& like) {
    workspace = torch::empty({static_cast<int64_t>(kernels::kEpilogueWorkspaceBytes)},
                             like.options().dtype(torch::kUInt8));
    context.handle = at::cuda::getCurrentCUDABlasLtHandle();
    context.workspace = workspace.data_ptr();
    context.workspace_bytes = kernels::kEpilogueWorkspaceBytes;
    context.stream = c10::cuda::getCurrentCUDAStream(like.device().index()).stream();
  }
};

// h = gelu_tanh(x2 W1^T + b1) for x2 [rows, in]; pre (same shape) kept when defined.
torch::Tensor fused_first_layer(const torch::Tensor& x2, const torch::Tensor& w1,
                                const torch::Tensor& b1, const torch::Tensor& pre) {
  const int64_t rows = x2.size(0), hidden = w1.size(0);
  auto h = torch::empty({rows, hidden}, x2.options());
  ProductContext p(x2);
  kernels::GeluGemmForward a;
  a.dtype = *kernel_dtype_of(x2.scalar_type());
  a.rows = rows, a.in_features = x2.size(1), a.hidden = hidden;
  a.x = x2.data_ptr(), a.weight = w1.data_ptr(), a.bias = b1.data_ptr();
  a.out = h.data_ptr();
  a.pre = pre.defined() ? pre.data_ptr() : nullptr;
  if (const char* error = kernels::gelu_gemm_forward(a, p.context)) {
    fail("MLP forward (fused GELU product, {} x {} -> {}): {}", rows, a.in_features, hidden, error);
  }
  return h;
}

// d_pre = (dy W2) * gelu'(pre) [rows, hidden] and, where the form makes it on the way, d_b1 (its
// column sums); else d_b1 undefined.
// The exact form has no cuBLASLt epilogue: always the `kernel` form, with erf's gelu'.
std::pair<torch::Tensor, torch::Tensor> hidden_gradients(const torch::Tensor& dy,
                                                         const torch::Tensor& w2c,
                                                         const torch::Tensor& pre, GeluForm gelu) {
  const int64_t rows = dy.size(0), out_features = w2c.size(0), hidden = w2c.size(1);
  const auto form = gelu == GeluForm::exact ? BackwardForm::kernel : backward_form();
  const auto dtype = *kernel_dtype_of(dy.scalar_type());
  auto stream = c10::cuda::getCurrentCUDAStream(dy.device().index()).stream();
  auto grad_pre = torch::empty({rows, hidden}, dy.options());
  if (form == BackwardForm::kernel) {
    auto grad_hidden = dy.mm(w2c);
    auto f32 = dy.options().dtype(torch::kFloat32);
    auto grad_b1 = torch::empty({hidden}, f32);
    auto workspace = torch::empty({static_cast<int64_t>(kernels::column_sum_workspace_floats(
                                      rows, static_cast<int>(hidden)))},
                                  f32);
    kernels::ColumnSumArgs a;
    a.dtype = dtype;
    a.rows = rows, a.cols = static_cast<int>(hidden);
    a.x = grad_hidden.data_ptr(), a.out = grad_b1.data_ptr<float>();
    a.workspace = workspace.data_ptr<float>();
    a.gelu_input = pre.data_ptr(), a.gelu_grad = grad_pre.data_ptr();
    a.gelu_exact = gelu == GeluForm::exact;
    const auto err = kernels::column_sum(a, stream);
    if (err != cudaSuccess) fail("MLP backward (GELU gradient, cuda): {}", cudaGetErrorString(err));
    return {grad_pre, grad_b1};
  }
  ProductContext p(dy);
  kernels::GeluGemmBackward a;
  a.dtype = dtype;
  a.rows = rows, a.out_features = out_features, a.hidden = hidden;
  a.grad_out = dy.data_ptr(), a.weight = w2c.data_ptr(), a.pre = pre.data_ptr();
  a.grad_pre = grad_pre.data_ptr();
  torch::Tensor grad_b1;
  if (form == BackwardForm::bgrad) {
    grad_b1 = torch::empty({hidden}, dy.options());
    a.grad_bias = grad_b1.data_ptr();
  }
  if (const char* error = kernels::gelu_gemm_backward(a, p.context)) {
    fail("MLP backward (GELU-gradient product, {} x {} -> {}): {}", rows, out_features, hidden,
         error);
  }
  return {grad_pre, grad_b1};  // epilogue: d_b1 undefined, the caller sums d_pre
}

// Saves x, W1, W2 in the compute dtype, pre and h. Gradients come back in the inputs' dtypes.
class FusedGeluMlpFunction : public torch::autograd::Function<FusedGeluMlpFunction> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& w1, const torch::Tensor& b1,
                               const torch::Tensor& w2, const torch::Tensor& b2, int64_t gelu) {
    const auto compute = linear_compute_dtype(x);
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    const c10::cuda::CUDAGuard on_device(x.device());
    const int64_t in = w1.size(1), hidden = w1.size(0);
    auto x2 = x.to(compute).reshape({-1, in}).contiguous();
    auto w1c = w1.to(compute).contiguous(), w2c = w2.to(compute).contiguous();
    const auto form = static_cast<GeluForm>(gelu);
    torch::Tensor pre, h;
    if (form == GeluForm::tanh) {
      pre = torch::empty({x2.size(0), hidden}, x2.options());
      h = fused_first_layer(x2, w1c, b1.to(compute).contiguous(), pre);
    } else {  // no epilogue computes erf's GELU: the product with its bias, then torch's GELU
      pre = torch::addmm(b1.to(compute), x2, w1c.t());
      h = torch::gelu(pre);
    }
    ctx->saved_data["gelu"] = gelu;
    auto out = torch::linear(h, w2c, b2.to(compute));
    ctx->save_for_backward({x2, w1c, w2c, pre, h});
    ctx->saved_data["x_type"] = static_cast<int64_t>(x.scalar_type());
    ctx->saved_data["w1_type"] = static_cast<int64_t>(w1.scalar_type());
    ctx->saved_data["b1_type"] = static_cast<int64_t>(b1.scalar_type());
    ctx->saved_data["w2_type"] = static_cast<int64_t>(w2.scalar_type());
    ctx->saved_data["b2_type"] = static_cast<int64_t>(b2.scalar_type());
    auto sizes = x.sizes().vec();
    sizes.back() = w2.size(0);
    return out.view(sizes);
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &x2 = saved[0], &w1c = saved[1], &w2c = saved[2], &pre = saved[3], &h = saved[4];
    auto type = [&](const char* key) {
      return static_cast<torch::ScalarType>(ctx->saved_data[key].toInt());
    };
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    const c10::cuda::CUDAGuard on_device(x2.device());
    const int64_t out_features = w2c.size(0);
    const auto x_sizes = grads[0].sizes().vec();
    auto dy = grads[0].to(w2c.scalar_type()).reshape({-1, out_features}).contiguous();
    torch::Tensor dx, dw1, db1, dw2, db2;
    if (ctx->needs_input_grad(3)) dw2 = dy.t().mm(h).to(type("w2_type"));
    if (ctx->needs_input_grad(4)) db2 = column_sums(dy).to(type("b2_type"));
    if (ctx->needs_input_grad(0) || ctx->needs_input_grad(1) || ctx->needs_input_grad(2)) {
      auto [grad_pre, grad_b1] =
          hidden_gradients(dy, w2c, pre, static_cast<GeluForm>(ctx->saved_data["gelu"].toInt()));
      if (ctx->needs_input_grad(0)) {
        auto sizes = x_sizes;
        sizes.back() = w1c.size(1);
        dx = grad_pre.mm(w1c).view(sizes).to(type("x_type"));
      }
      if (ctx->needs_input_grad(1)) dw1 = grad_pre.t().mm(x2).to(type("w1_type"));
      if (ctx->needs_input_grad(2)) {
        if (!grad_b1.defined()) grad_b1 = column_sums(grad_pre);
        db1 = grad_b1.to(type("b1_type"));
      }
    }
    return {dx, dw1, db1, dw2, db2, torch::Tensor()};
  }
};
#endif

}  // namespace

bool gelu_mlp_fuses(const torch::Tensor& x, const torch::Tensor& w1, const torch::Tensor& b1,
                    const torch::Tensor& w2, const torch::Tensor& b2, GeluForm form) {
#ifdef MHLA_WITH_CUDA_KERNELS
  (void)form;  // both forms fuse (the exact one in its backward)
  if (!fused_mlp_enabled() || !x.is_cuda() || !b1.defined() || !b2.defined() || x.dim() < 2 ||
      !x.is_floating_point()) {
    return false;
  }
  const auto compute = linear_compute_dtype(x);
  if (compute == torch::kFloat64 || !kernel_dtype_of(compute)) return false;
  const int64_t in = w1.size(1), hidden = w1.size(0), out = w2.size(0);
  return x.size(-1) == in && w2.size(1) == hidden &&
         mhla_kernels::gelu_gemm_supported(x.numel() / in, in, hidden) &&
         mhla_kernels::gelu_gemm_supported(x.numel() / in, out, hidden);
#else
  return false;
#endif
}

torch::Tensor gelu_mlp_reference(const torch::Tensor& x, const torch::Tensor& w1,
                                 const torch::Tensor& b1, const torch::Tensor& w2,
                                 const torch::Tensor& b2, GeluForm form) {
  const auto approximate = form == GeluForm::tanh ? "tanh" : "none";
  return linear(torch::gelu(linear(x, w1, b1), approximate), w2, b2);
}

torch::Tensor gelu_mlp(const torch::Tensor& x, const torch::Tensor& w1, const torch::Tensor& b1,
                       const torch::Tensor& w2, const torch::Tensor& b2, GeluForm form) {
#ifdef MHLA_WITH_CUDA_KERNELS
  if (gelu_mlp_fuses(x, w1, b1, w2, b2, form)) {
    const bool training = torch::GradMode::is_enabled() &&
                          (x.requires_grad() || w1.requires_grad() || b1.requires_grad() ||
                           w2.requires_grad() || b2.requires_grad());
    if (training) return FusedGeluMlpFunction::apply(x, w1, b1, w2, b2, static_cast<int64_t>(form));
    // Inference in the exact form: nothing to fuse (no epilogue computes erf's GELU).
    if (form == GeluForm::exact) return gelu_mlp_reference(x, w1, b1, w2, b2, form);
    // Inference: the GELU fused into the first product, pre not kept.
    const auto compute = linear_compute_dtype(x);
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    const c10::cuda::CUDAGuard on_device(x.device());
    auto x2 = x.to(compute).reshape({-1, w1.size(1)}).contiguous();
    auto h = fused_first_layer(x2, w1.to(compute).contiguous(), b1.to(compute).contiguous(),
                               torch::Tensor());
    auto sizes = x.sizes().vec();
    sizes.back() = w2.size(0);
    return torch::linear(h, w2.to(compute), b2.to(compute)).view(sizes);
  }
#endif
  return gelu_mlp_reference(x, w1, b1, w2, b2, form);
}

}  // namespace mhla
