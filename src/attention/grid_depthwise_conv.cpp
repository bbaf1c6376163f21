#include "attention/grid_depthwise_conv.h"

#include <mutex>

#include "core/environment.h"
#include "core/error.h"
#include "core/logging.h"

#ifdef MHLA_WITH_CUDA_KERNELS
#include <c10/cuda/CUDAGuard.h>

#include "core/cuda_stream.h"
#include "core/kernel_dtype.h"
#include "grid_conv/grid_depthwise_conv.h"
#endif

namespace mhla {
namespace {

void check_shapes(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias,
                  const TokenLayout& layout) {
  const bool square = weight.dim() == 4 && weight.size(2) == weight.size(3);
  if (x.dim() != 3 || x.size(1) != layout.tokens() || !square || weight.size(1) != 1 ||
      weight.size(0) != x.size(2) || weight.size(2) % 2 == 0 ||
      (bias.defined() && (bias.dim() != 1 || bias.size(0) != x.size(2)))) {
    fail(
        "grid depthwise conv: x {} (want [B, {}, C] for a {} x {} grid), weight {} (want "
        "[C, 1, k, k], k odd) and bias {} (want [C]) do not match",
        c10::str(x.sizes()), layout.tokens(), layout.grid_h, layout.grid_w,
        c10::str(weight.sizes()), bias.defined() ? c10::str(bias.sizes()) : "none");
  }
}

#ifdef MHLA_WITH_CUDA_KERNELS
namespace kernels = mhla_kernels;
using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;

kernels::GridConvArgs args_for(const torch::Tensor& x, const TokenLayout& layout) {
  kernels::GridConvArgs a;
  a.dtype = *kernel_dtype_of(x.scalar_type());
  a.batch = static_cast<int>(x.size(0)), a.channels = static_cast<int>(x.size(2));
  a.grid_h = static_cast<int>(layout.grid_h), a.grid_w = static_cast<int>(layout.grid_w);
  a.tiles_h = static_cast<int>(layout.tiles_h), a.tiles_w = static_cast<int>(layout.tiles_w);
  a.x = x.data_ptr(), a.x_batch_stride = x.stride(0), a.x_token_stride = x.stride(1);
  return a;
}

// Whether the kernels read x where it lies: rows of C contiguous elements, 16-byte aligned rows.
bool readable_in_place(const torch::Tensor& x) {
  const int64_t vector = 16 / static_cast<int64_t>(x.element_size());
  return x.stride(2) == 1 && x.stride(1) % vector == 0 && x.stride(0) % vector == 0 &&
         reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0;
}

class GridConvFunction : public torch::autograd::Function<GridConvFunction> {
 public:
  // base: [B, N, C] contiguous in x's dtype, added to the output, or empty.
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x_in,
                               const torch::Tensor& weight_in, const torch::Tensor& bias_in,
                               const torch::Tensor& base, int64_t grid_h, int64_t grid_w,
                               int64_t tiles_h, int64_t tiles_w) {
    c10::cuda::CUDAGuard on_device(x_in.device());
    const TokenLayout layout{grid_h, grid_w, tiles_h, tiles_w};
    auto x = readable_in_place(x_in) ? x_in : x_in.contiguous();
    auto weight = weight_in.contiguous();
    // The kernels read the weights as float4s.
    if (reinterpret_cast<uintptr_t>(weight.data_ptr()) % 16 != 0) weight = weight.clone();
    // No bias: an empty tensor (autograd's functions take no undefined inputs).
    const bool has_bias = bias_in.numel() > 0;
    auto bias = has_bias ? bias_in.contiguous() : bias_in;
    auto a = args_for(x, layout);
    a.weight = weight.data_ptr<float>();
    a.bias = has_bias ? bias.data_ptr<float>() : nullptr;
    auto out = torch::empty({x.size(0), x.size(1), x.size(2)}, x.options());
    a.out = out.data_ptr();
    const bool has_base = base.numel() > 0;
    if (has_base) a.base = base.data_ptr();
    const auto err = kernels::grid_conv_forward(a, stream_of(x));
    if (err != cudaSuccess) fail("grid depthwise conv (cuda): {}", cudaGetErrorString(err));
    ctx->save_for_backward({x, weight});
    ctx->saved_data["layout"] = std::vector<int64_t>{grid_h, grid_w, tiles_h, tiles_w};
    ctx->saved_data["bias"] = has_bias;
    ctx->saved_data["base"] = has_base;
    return out;
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &x = saved[0], &weight = saved[1];
    c10::cuda::CUDAGuard on_device(x.device());
    const auto l = ctx->saved_data["layout"].toIntVector();
    const TokenLayout layout{l[0], l[1], l[2], l[3]};
    const bool has_bias = ctx->saved_data["bias"].toBool();
    if (!grads[0].defined()) {  // the output took no part in the loss
      return {torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor(),
              torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
    }
    auto dout = grads[0].to(x.scalar_type()).contiguous();
    auto a = args_for(x, layout);
    auto dx = torch::empty({x.size(0), x.size(1), x.size(2)}, x.options());
    auto f32 = x.options().dtype(torch::kFloat32);
    auto dweight = torch::empty(weight.sizes(), f32);
    auto dbias = has_bias ? torch::empty({x.size(2)}, f32) : torch::Tensor();
    auto workspace =
        torch::empty({static_cast<int64_t>(kernels::grid_conv_workspace_floats(a))}, f32);
    a.weight = weight.data_ptr<float>();
    a.dout = dout.data_ptr(), a.dx = dx.data_ptr();
    a.dweight = dweight.data_ptr<float>();
    a.dbias = has_bias ? dbias.data_ptr<float>() : nullptr;
    a.workspace = workspace.data_ptr<float>();
    const auto err = kernels::grid_conv_backward(a, stream_of(x));
    if (err != cudaSuccess)
      fail("grid depthwise conv backward (cuda): {}", cudaGetErrorString(err));
    // The base's gradient is the output's.
    auto dbase = ctx->saved_data["base"].toBool() ? dout : torch::Tensor();
    return {dx,
            dweight,
            dbias,
            dbase,
            torch::Tensor(),
            torch::Tensor(),
            torch::Tensor(),
            torch::Tensor()};
  }
};

bool kernel_takes(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias,
                  const TokenLayout& layout) {
  if (!x.is_cuda() || !kernel_dtype_of(x.scalar_type()).has_value()) return false;
  if (weight.scalar_type() != torch::kFloat32 || weight.device() != x.device() ||
      weight.size(2) != kernels::kGridConvKernel)
    return false;
  if (bias.defined() && (bias.scalar_type() != torch::kFloat32 || bias.device() != x.device()))
    return false;
  if (x.size(0) > INT32_MAX || x.size(2) > INT32_MAX || layout.grid_h > INT32_MAX ||
      layout.grid_w > INT32_MAX)
    return false;
  return kernels::grid_conv_supported(args_for(x, layout));
}
#endif

}  // namespace

torch::Tensor grid_depthwise_conv_reference(const torch::Tensor& x, const torch::Tensor& weight,
                                            const torch::Tensor& bias, const TokenLayout& layout) {
  check_shapes(x, weight, bias, layout);
  namespace F = torch::nn::functional;
  // In x's dtype, as autocast would have it (conv2d wants one dtype).
  auto options = F::Conv2dFuncOptions().padding(weight.size(2) / 2).groups(x.size(2));
  if (bias.defined()) options = options.bias(bias.to(x.scalar_type()));
  return layout.to_tokens(F::conv2d(layout.to_grid(x), weight.to(x.scalar_type()), options));
}

torch::Tensor grid_depthwise_conv_kernel(const torch::Tensor& x, const torch::Tensor& weight,
                                         const torch::Tensor& bias, const TokenLayout& layout,
                                         const torch::Tensor& base) {
  check_shapes(x, weight, bias, layout);
  if (base.defined() && base.sizes() != x.sizes()) {
    fail("grid depthwise conv kernel: base {} is not x's shape {}", c10::str(base.sizes()),
         c10::str(x.sizes()));
  }
#ifdef MHLA_WITH_CUDA_KERNELS
  if (!kernel_takes(x, weight, bias, layout)) {
    fail(
        "grid depthwise conv kernel: needs x on CUDA in fp32/bf16/fp16 with C a multiple of 16 "
        "bytes, an fp32 weight (and bias) on the same device, kernel size {}, tiles that divide "
        "the grid and a grid at most 260 tokens wide (got {} {}, C = {}, weight {} {}, kernel {}, "
        "{} x {} tiles of a {} x {} grid)",
        kernels::kGridConvKernel, c10::toString(x.scalar_type()), x.device().str(), x.size(2),
        c10::toString(weight.scalar_type()), weight.device().str(), weight.size(2), layout.tiles_h,
        layout.tiles_w, layout.grid_h, layout.grid_w);
  }
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  auto bias_or_empty = bias.defined() ? bias : torch::empty({0}, weight.options());
  // The kernel reads the base as contiguous rows in x's dtype.
  auto base_or_empty = base.defined() ? base.to(x.device(), x.scalar_type()).contiguous()
                                      : torch::empty({0}, x.options());
  return GridConvFunction::apply(x, weight, bias_or_empty, base_or_empty, layout.grid_h,
                                 layout.grid_w, layout.tiles_h, layout.tiles_w);
#else
  fail("grid depthwise conv kernel: this build has no CUDA kernels");
#endif
}

namespace {

// Whether grid_depthwise_conv runs the kernel: on CUDA unless MHLA_FUSED_GRID_CONV=0, for what
// the kernel takes. Where a CUDA input is not taken, the run's log says so once (slower, not
// wrong: the log explains the run's speed).
bool runs_kernel(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias,
                 const TokenLayout& layout) {
#ifdef MHLA_WITH_CUDA_KERNELS
  static const bool enabled = environment_switch("MHLA_FUSED_GRID_CONV", true);
  if (!enabled || !x.is_cuda()) return false;
  if (kernel_takes(x, weight, bias, layout)) return true;
  static std::once_flag once;
  std::call_once(once, [&] {
    logger().info(
        "attention.cpe: a {} x {} kernel on {} with C = {} on a {} x {} grid runs ATen's conv2d "
        "and token gathers (the grid-conv kernel takes kernel size {}, 16-byte channel vectors, "
        "fp32 weights, grids at most 260 tokens wide)",
        weight.size(2), weight.size(3), c10::toString(x.scalar_type()), x.size(2), layout.grid_h,
        layout.grid_w, kernels::kGridConvKernel);
  });
#else
  (void)x, (void)weight, (void)bias, (void)layout;
#endif
  return false;
}

}  // namespace

torch::Tensor grid_depthwise_conv(const torch::Tensor& x, const torch::Tensor& weight,
                                  const torch::Tensor& bias, const TokenLayout& layout) {
  check_shapes(x, weight, bias, layout);
  if (runs_kernel(x, weight, bias, layout))
    return grid_depthwise_conv_kernel(x, weight, bias, layout);
  return grid_depthwise_conv_reference(x, weight, bias, layout);
}

torch::Tensor grid_depthwise_conv_added(const torch::Tensor& base, const torch::Tensor& x,
                                        const torch::Tensor& weight, const torch::Tensor& bias,
                                        const TokenLayout& layout) {
  check_shapes(x, weight, bias, layout);
  // One pass when the base is what the kernel writes (x's dtype and shape, contiguous rows).
  if (base.scalar_type() == x.scalar_type() && base.sizes() == x.sizes() &&
      base.device() == x.device() && base.is_contiguous() && runs_kernel(x, weight, bias, layout)) {
    return grid_depthwise_conv_kernel(x, weight, bias, layout, base);
  }
  return base + grid_depthwise_conv(x, weight, bias, layout).to(base.scalar_type());
}

}  // namespace mhla
