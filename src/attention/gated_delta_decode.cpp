#include "attention/gated_delta_decode.h"

#include "attention/gated_delta.h"
#include "core/error.h"

#ifdef MHLA_WITH_CUDA_KERNELS
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "core/kernel_dtype.h"
#include "gated_delta/decode.h"
#endif

namespace mhla {

bool delta_rule_decode_uses_kernel(const torch::Tensor& state, const torch::Tensor& q,
                                   const torch::Tensor& k, const torch::Tensor& v,
                                   const torch::Tensor& beta, const torch::Tensor& g) {
#ifdef MHLA_WITH_CUDA_KERNELS
  if (!state.is_cuda() || state.scalar_type() != torch::kFloat32 || state.dim() != 4) return false;
  const auto device = state.device();
  for (const auto* t : {&q, &k, &v, &beta, &g}) {
    if (t->device() != device) return false;
  }
  const auto b = state.size(0), h = state.size(1), dk = state.size(2), dv = state.size(3);
  const auto type = v.scalar_type();
  const bool dtypes =
      (type == torch::kFloat32 || type == torch::kFloat16 || type == torch::kBFloat16) &&
      q.scalar_type() == type && k.scalar_type() == type;
  const bool shapes = q.sizes().equals({b, h, dk}) && k.sizes().equals({b, h, dk}) &&
                      v.sizes().equals({b, h, dv}) && beta.sizes().equals({b, h}) &&
                      (g.sizes().equals({b, h}) || g.sizes().equals({b, h, dk}));
  // The kernel updates the state in place outside autograd: only where no gradient is wanted.
  const bool no_grad = !torch::GradMode::is_enabled() ||
                       !(q.requires_grad() || k.requires_grad() || v.requires_grad() ||
                         beta.requires_grad() || g.requires_grad() || state.requires_grad());
  return dtypes && shapes && no_grad && dk <= 256 && state.numel() > 0;
#else
  return false;
#endif
}

torch::Tensor delta_rule_decode(torch::Tensor& state, const torch::Tensor& q,
                                const torch::Tensor& k, const torch::Tensor& v,
                                const torch::Tensor& beta, const torch::Tensor& g, double scale) {
#ifdef MHLA_WITH_CUDA_KERNELS
  const auto type = v.scalar_type();
  const bool takes = delta_rule_decode_uses_kernel(state, q, k, v, beta, g);
  if (takes) {
    namespace kernels = mhla_kernels;
    c10::cuda::CUDAGuard on_device(state.device());
    if (!state.is_contiguous()) state = state.contiguous();
    auto qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
    auto beta_f = beta.to(torch::kFloat32).contiguous(), g_f = g.to(torch::kFloat32).contiguous();
    auto out = torch::empty(v.sizes(), vc.options());
    kernels::DeltaDecodeArgs a;
    a.dtype = *kernel_dtype_of(type);  // uses_kernel checked it
    a.batch = static_cast<int>(q.size(0)), a.heads = static_cast<int>(q.size(1));
    a.key_dim = static_cast<int>(q.size(2)), a.value_dim = static_cast<int>(v.size(2));
    a.q = qc.data_ptr(), a.k = kc.data_ptr(), a.v = vc.data_ptr();
    a.beta = beta_f.data_ptr<float>(), a.g = g_f.data_ptr<float>();
    a.per_key_gate = g.dim() == 3;
    a.state = state.data_ptr<float>();
    a.out = out.data_ptr();
    a.scale = static_cast<float>(scale);
    auto stream = c10::cuda::getCurrentCUDAStream(q.device().index()).stream();
    const auto err = kernels::delta_rule_decode(a, stream);
    if (err != cudaSuccess) fail("gated delta decode (cuda): {}", cudaGetErrorString(err));
    return out;
  }
#endif
  return delta_rule_step(state, q, k, v, beta, g, scale);
}

}  // namespace mhla
