#include "attention/rotary.h"

#include <map>
#include <tuple>

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
std::pair<torch::Tensor, torch::Tensor> compute_tables(int64_t first_position, int64_t tokens,
                                                       int64_t head_dim, double base,
                                                       const torch::Device& device) {
  const auto half = head_dim / 2;
  auto f32 = torch::TensorOptions().dtype(torch::kFloat32).device(device);
  auto inv_freq =
      torch::pow(base, -torch::arange(0, half, f32) * 2.0 / static_cast<double>(head_dim));
  auto angles = torch::arange(first_position, first_position + tokens, f32).unsqueeze(1) * inv_freq;
  return {angles.cos(), angles.sin()};
}

// Training asks for the same tables in every layer and step (position 0, the context length):
// they are kept per thread, device and shape instead of six small kernels per call, and never
// evicted, since a captured CUDA graph (train.cuda_graph) reads them by address for the rest of
// the run (a few KiB per shape). Decoding (a new first position each step) computes them afresh.
std::pair<torch::Tensor, torch::Tensor> rotary_tables(int64_t first_position, int64_t tokens,
                                                      int64_t head_dim, double base,
                                                      const torch::Device& device) {
  if (first_position != 0) return compute_tables(first_position, tokens, head_dim, base, device);
  using Key = std::tuple<int, int, int64_t, int64_t, double>;
  thread_local std::map<Key, std::pair<torch::Tensor, torch::Tensor>> cache;
  const Key key{static_cast<int>(device.type()), device.index(), tokens, head_dim, base};
  auto it = cache.find(key);
  if (it == cache.end()) {
    it = cache.emplace(key, compute_tables(0, tokens, head_dim, base, device)).first;
  }
  return it->second;
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

kernels::TokenTensor view_of(const torch::Tensor& x) {
  return {x.data_ptr(), x.stride(0), x.stride(1), x.stride(2)};
}

kernels::MutableTokenTensor mutable_view_of(torch::Tensor& x) {
  return {x.data_ptr(), x.stride(0), x.stride(1), x.stride(2)};
}

// One launch over up to three [B, T, H, D] views: the first `rotated` rotated (by the opposite
// angles when backward), the rest copied.
void run_kernel(const std::vector<torch::Tensor>& in, std::vector<torch::Tensor>& out, int rotated,
                const torch::Tensor& cos, const torch::Tensor& sin, bool opposite) {
  const auto& x = in[0];
  c10::cuda::CUDAGuard on_device(x.device());
  kernels::RotaryArgs a;
  const auto dtype = kernel_dtype_of(x.scalar_type());
  if (!dtype) fail("rotary (cuda): unsupported dtype {}", c10::toString(x.scalar_type()));
  a.dtype = *dtype;
  a.parts = static_cast<int>(in.size());
  a.rotated = rotated;
  for (size_t p = 0; p < in.size(); ++p) {
    TORCH_CHECK(in[p].stride(3) == 1 && out[p].stride(3) == 1 &&
                    in[p].scalar_type() == x.scalar_type() && in[p].sizes() == x.sizes(),
                "rotary (cuda): views must match, last dimension contiguous");
    a.in[p] = view_of(in[p]);
    a.out[p] = mutable_view_of(out[p]);
  }
  a.cos = cos.data_ptr<float>();
  a.sin = sin.data_ptr<float>();
  a.sin_sign = opposite ? -1.f : 1.f;
  a.batch = static_cast<int>(x.size(0)), a.tokens = static_cast<int>(x.size(1));
  a.heads = static_cast<int>(x.size(2)), a.head_dim = static_cast<int>(x.size(3));
  auto stream = c10::cuda::getCurrentCUDAStream(x.device().index()).stream();
  const auto err = kernels::rotary_embedding(a, stream);
  if (err != cudaSuccess) fail("rotary embedding (cuda): {}", cudaGetErrorString(err));
}

torch::Tensor last_dim_contiguous(const torch::Tensor& x) {
  return x.stride(3) == 1 ? x : x.contiguous();
}

torch::Tensor contiguous_like(const torch::Tensor& x) {
  return torch::empty(x.sizes(), x.options().memory_format(torch::MemoryFormat::Contiguous));
}

// The rotation is orthogonal, so its backward is the rotation by the opposite angles: this same
// function with `opposite` flipped, which keeps higher-order gradients correct too.
class RotaryFunction : public torch::autograd::Function<RotaryFunction> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& cos, const torch::Tensor& sin, bool opposite) {
    ctx->save_for_backward({cos, sin});
    ctx->saved_data["opposite"] = opposite;
    std::vector<torch::Tensor> out{contiguous_like(x)};
    run_kernel({last_dim_contiguous(x)}, out, 1, cos, sin, opposite);
    return out[0];
  }
  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    if (!grads[0].defined()) return {torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
    auto saved = ctx->get_saved_variables();
    return {RotaryFunction::apply(grads[0], saved[0], saved[1],
                                  !ctx->saved_data["opposite"].toBool()),
            torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

class MergeQkvFunction;

// qkv [B, T, 3, H, D] -> q and k rotated, v copied: three contiguous [B, T, H, D] tensors in one
// launch. Backward: MergeQkvFunction (dq, dk rotated back and dv written into one [B, T, 3, H, D]
// gradient in one launch, instead of rotating dq and dk separately and then stacking).
class SplitQkvFunction : public torch::autograd::Function<SplitQkvFunction> {
 public:
  static torch::autograd::tensor_list forward(torch::autograd::AutogradContext* ctx,
                                              const torch::Tensor& qkv, const torch::Tensor& cos,
                                              const torch::Tensor& sin, bool opposite);
  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads);
};

// (q, k, v) [B, T, H, D] -> [B, T, 3, H, D] with q and k rotated: the split's adjoint.
class MergeQkvFunction : public torch::autograd::Function<MergeQkvFunction> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& q,
                               const torch::Tensor& k, const torch::Tensor& v,
                               const torch::Tensor& cos, const torch::Tensor& sin, bool opposite) {
    ctx->save_for_backward({cos, sin});
    ctx->saved_data["opposite"] = opposite;
    const auto s = q.sizes();
    auto merged = torch::empty({s[0], s[1], 3, s[2], s[3]}, q.options());
    std::vector<torch::Tensor> out{merged.select(2, 0), merged.select(2, 1), merged.select(2, 2)};
    run_kernel({last_dim_contiguous(q), last_dim_contiguous(k), last_dim_contiguous(v)}, out, 2,
               cos, sin, opposite);
    return merged;
  }
  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    torch::autograd::tensor_list none(6);
    if (!grads[0].defined()) return none;
    auto saved = ctx->get_saved_variables();
    auto parts = SplitQkvFunction::apply(grads[0], saved[0], saved[1],
                                         !ctx->saved_data["opposite"].toBool());
    return {parts[0], parts[1], parts[2], torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

torch::autograd::tensor_list SplitQkvFunction::forward(torch::autograd::AutogradContext* ctx,
                                                       const torch::Tensor& qkv,
                                                       const torch::Tensor& cos,
                                                       const torch::Tensor& sin, bool opposite) {
  ctx->save_for_backward({cos, sin});
  ctx->saved_data["opposite"] = opposite;
  auto x = qkv.stride(4) == 1 ? qkv : qkv.contiguous();
  std::vector<torch::Tensor> in{x.select(2, 0), x.select(2, 1), x.select(2, 2)};
  std::vector<torch::Tensor> out{contiguous_like(in[0]), contiguous_like(in[0]),
                                 contiguous_like(in[0])};
  run_kernel(in, out, 2, cos, sin, opposite);
  return out;
}

torch::autograd::tensor_list SplitQkvFunction::backward(torch::autograd::AutogradContext* ctx,
                                                        torch::autograd::tensor_list grads) {
  torch::autograd::tensor_list none(4);
  if (!grads[0].defined() && !grads[1].defined() && !grads[2].defined()) return none;
  // A part that got no gradient (unused output) counts as zeros.
  torch::Tensor like;
  for (const auto& g : grads) {
    if (g.defined()) like = g;
  }
  for (auto& g : grads) {
    if (!g.defined()) g = torch::zeros(like.sizes(), like.options());
  }
  auto saved = ctx->get_saved_variables();
  return {MergeQkvFunction::apply(grads[0], grads[1], grads[2], saved[0], saved[1],
                                  !ctx->saved_data["opposite"].toBool()),
          torch::Tensor(), torch::Tensor(), torch::Tensor()};
}

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
  if (kernel_takes(x) && x.numel() > 0) return RotaryFunction::apply(x, cos, sin, false);
#endif
  return rotate_reference(x, cos, sin);
}

}  // namespace mhla

namespace mhla {

std::array<torch::Tensor, 3> split_rotary_qkv(const torch::Tensor& qkv, int64_t first_position,
                                              double base) {
  TORCH_CHECK(qkv.dim() == 5 && qkv.size(2) == 3,
              "rotary embedding: expected a fused projection [B, T, 3, H, D], got ", qkv.sizes());
  TORCH_CHECK(qkv.size(4) % 2 == 0, "rotary embedding needs an even head dimension");
#ifdef MHLA_WITH_CUDA_KERNELS
  if (kernel_takes(qkv) && qkv.numel() > 0) {
    auto [cos, sin] = rotary_tables(first_position, qkv.size(1), qkv.size(4), base, qkv.device());
    auto parts = SplitQkvFunction::apply(qkv, cos, sin, false);
    return {parts[0], parts[1], parts[2]};
  }
#endif
  auto parts = qkv.unbind(2);
  return {apply_rotary_reference(parts[0], first_position, base),
          apply_rotary_reference(parts[1], first_position, base), parts[2]};
}

}  // namespace mhla
