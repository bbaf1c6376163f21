#include "attention/rotary.h"

#include "core/error.h"

#ifdef MHLA_WITH_CUDA_KERNELS
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "core/kernel_dtype.h"
#include "rotary/rotary.h"
#endif

namespace mhla {

namespace {

// cos and sin of every (token, frequency) angle, fp32 [T, D/2]: shared by the reference and the
// kernel so that both rotate by the same angles.
std::pair<torch::Tensor, torch::Tensor> rotary_tables(int64_t first_position, int64_t tokens,
                                                      int64_t head_dim, double base,
                                                      const torch::Device& device) {
  const auto half = head_dim / 2;
  auto f32 = torch::TensorOptions().dtype(torch::kFloat32).device(device);
  auto inv_freq =
      torch::pow(base, -torch::arange(0, half, f32) * 2.0 / static_cast<double>(head_dim));
  auto angles = torch::arange(first_position, first_position + tokens, f32).unsqueeze(1) * inv_freq;
  return {angles.cos(), angles.sin()};
}

torch::Tensor rotate_reference(const torch::Tensor& x, const torch::Tensor& cos_table,
                               const torch::Tensor& sin_table) {
  const auto t = x.size(1), half = x.size(3) / 2;
  auto cos = cos_table.view({1, t, 1, half}), sin = sin_table.view({1, t, 1, half});
  auto xf = x.to(torch::kFloat32);
  auto x1 = xf.narrow(-1, 0, half), x2 = xf.narrow(-1, half, half);
  return torch::cat({x1 * cos - x2 * sin, x2 * cos + x1 * sin}, -1).to(x.scalar_type());
}

void check_shape(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 4, "rotary embedding: expected [B, T, H, D], got ", x.sizes());
  TORCH_CHECK(x.size(3) % 2 == 0, "rotary embedding needs an even head dimension");
}

#ifdef MHLA_WITH_CUDA_KERNELS

namespace kernels = mhla_kernels;

bool kernel_takes(const torch::Tensor& x) {
  const auto type = x.scalar_type();
  return x.is_cuda() &&
         (type == torch::kFloat32 || type == torch::kBFloat16 || type == torch::kFloat16);
}

torch::Tensor rotate_on_gpu(const torch::Tensor& x_in, const torch::Tensor& cos,
                            const torch::Tensor& sin) {
  c10::cuda::CUDAGuard on_device(x_in.device());
  auto x = x_in.stride(3) == 1 ? x_in : x_in.contiguous();
  auto out = torch::empty(x.sizes(), x.options().memory_format(torch::MemoryFormat::Contiguous));
  kernels::RotaryArgs a;
  const auto dtype = kernel_dtype_of(x.scalar_type());
  if (!dtype) fail("rotary (cuda): unsupported dtype {}", c10::toString(x.scalar_type()));
  a.dtype = *dtype;
  a.x = {x.data_ptr(), x.stride(0), x.stride(1), x.stride(2)};
  a.out = out.data_ptr();
  a.cos = cos.data_ptr<float>();
  a.sin = sin.data_ptr<float>();
  a.batch = static_cast<int>(x.size(0)), a.tokens = static_cast<int>(x.size(1));
  a.heads = static_cast<int>(x.size(2)), a.head_dim = static_cast<int>(x.size(3));
  auto stream = c10::cuda::getCurrentCUDAStream(x.device().index()).stream();
  const auto err = kernels::rotary_embedding(a, stream);
  if (err != cudaSuccess) fail("rotary embedding (cuda): {}", cudaGetErrorString(err));
  return out;
}

// The rotation is orthogonal, so its backward is the rotation by the opposite angles: this same
// function with sin negated, which keeps higher-order gradients correct too.
class RotaryFunction : public torch::autograd::Function<RotaryFunction> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& cos, const torch::Tensor& sin) {
    ctx->save_for_backward({cos, sin});
    return rotate_on_gpu(x, cos, sin);
  }
  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    if (!grads[0].defined()) return {torch::Tensor(), torch::Tensor(), torch::Tensor()};
    auto saved = ctx->get_saved_variables();
    return {RotaryFunction::apply(grads[0], saved[0], saved[1].neg()), torch::Tensor(),
            torch::Tensor()};
  }
};

#endif

}  // namespace

torch::Tensor apply_rotary_reference(const torch::Tensor& x, int64_t first_position, double base) {
  check_shape(x);
  auto [cos, sin] = rotary_tables(first_position, x.size(1), x.size(3), base, x.device());
  return rotate_reference(x, cos, sin);
}

torch::Tensor apply_rotary(const torch::Tensor& x, int64_t first_position, double base) {
  check_shape(x);
  auto [cos, sin] = rotary_tables(first_position, x.size(1), x.size(3), base, x.device());
#ifdef MHLA_WITH_CUDA_KERNELS
  if (kernel_takes(x) && x.numel() > 0) return RotaryFunction::apply(x, cos, sin);
#endif
  return rotate_reference(x, cos, sin);
}

}  // namespace mhla
