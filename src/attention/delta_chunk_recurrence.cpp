#include "attention/delta_chunk_recurrence.h"

#include "core/error.h"

#ifdef MHLA_WITH_CUDA_KERNELS
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "gated_delta/chunk_recurrence.h"
#endif

namespace mhla {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct Loop {
  torch::Tensor per_chunk_a, per_chunk_b, last;
};

// Forward: (S_i for every chunk, u_i for every chunk, S_n).
Loop forward_reference(const torch::Tensor& u0, const torch::Tensor& w, const torch::Tensor& kt,
                       const torch::Tensor& decay, const torch::Tensor& s0) {
  const int64_t chunks = u0.size(2);
  auto state = s0;
  std::vector<torch::Tensor> states, us;
  for (int64_t i = 0; i < chunks; ++i) {
    states.push_back(state);
    auto u = u0.select(2, i) - torch::matmul(w.select(2, i), state);
    us.push_back(u);
    state = decay.select(2, i).unsqueeze(-1) * state +
            torch::matmul(kt.select(2, i).transpose(-1, -2), u);
  }
  return {torch::stack(states, 2), torch::stack(us, 2), state};
}

// Backward, the same recurrence reversed: with dS the gradient of the state leaving chunk i,
//   du_i  = du_i(from the outputs) + Kt_i dS
//   dS_i  = Diag(decay_i) dS + dS_i(from the outputs) - W_i^T du_i
// returns (du_i for every chunk, the dS leaving each chunk, dS_0).
Loop backward_reference(const torch::Tensor& du, const torch::Tensor& dstates,
                        const torch::Tensor& dfinal, const torch::Tensor& w,
                        const torch::Tensor& kt, const torch::Tensor& decay) {
  const int64_t chunks = du.size(2);
  auto ds = dfinal;
  std::vector<torch::Tensor> du_total(chunks), ds_after(chunks);
  for (int64_t i = chunks - 1; i >= 0; --i) {
    auto x = du.select(2, i) + torch::matmul(kt.select(2, i), ds);
    du_total[i] = x;
    ds_after[i] = ds;
    ds = decay.select(2, i).unsqueeze(-1) * ds + dstates.select(2, i) -
         torch::matmul(w.select(2, i).transpose(-1, -2), x);
  }
  return {torch::stack(du_total, 2), torch::stack(ds_after, 2), ds};
}

#ifdef MHLA_WITH_CUDA_KERNELS
namespace kernels = mhla_kernels;

kernels::DeltaChunkArgs kernel_args(const torch::Tensor& w) {
  kernels::DeltaChunkArgs a;
  a.batch_heads = static_cast<int>(w.size(0) * w.size(1));
  a.chunks = static_cast<int>(w.size(2));
  a.chunk = static_cast<int>(w.size(3));
  a.key_dim = static_cast<int>(w.size(4));
  return a;
}

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess)
    fail("gated delta chunk recurrence ({}, cuda): {}", what, cudaGetErrorString(err));
}

Loop forward_kernel(const torch::Tensor& u0, const torch::Tensor& w, const torch::Tensor& kt,
                    const torch::Tensor& decay, const torch::Tensor& s0) {
  c10::cuda::CUDAGuard on_device(u0.device());
  const auto b = u0.size(0), h = u0.size(1), n = u0.size(2), dk = w.size(4), dv = u0.size(4);
  auto states = torch::empty({b, h, n, dk, dv}, u0.options());
  auto u = torch::empty_like(u0);
  auto final = torch::empty({b, h, dk, dv}, u0.options());
  auto a = kernel_args(w);
  a.value_dim = static_cast<int>(dv);
  a.x = u0.data_ptr<float>(), a.w = w.data_ptr<float>(), a.kt = kt.data_ptr<float>();
  a.decay = decay.data_ptr<float>(), a.state_in = s0.data_ptr<float>();
  a.per_chunk_state = states.data_ptr<float>(), a.y = u.data_ptr<float>();
  a.state_out = final.data_ptr<float>();
  check(kernels::delta_chunk_forward(a,
                                     c10::cuda::getCurrentCUDAStream(u0.device().index()).stream()),
        "forward");
  return {states, u, final};
}

Loop backward_kernel(const torch::Tensor& du, const torch::Tensor& dstates,
                     const torch::Tensor& dfinal, const torch::Tensor& w, const torch::Tensor& kt,
                     const torch::Tensor& decay) {
  c10::cuda::CUDAGuard on_device(du.device());
  auto du_total = torch::empty_like(du);
  auto ds_after = torch::empty_like(dstates);
  auto ds0 = torch::empty_like(dfinal);
  auto a = kernel_args(w);
  a.value_dim = static_cast<int>(du.size(4));
  a.x = du.data_ptr<float>(), a.w = w.data_ptr<float>(), a.kt = kt.data_ptr<float>();
  a.decay = decay.data_ptr<float>(), a.state_in = dfinal.data_ptr<float>();
  a.state_grad_in = dstates.data_ptr<float>();
  a.per_chunk_state = ds_after.data_ptr<float>(), a.y = du_total.data_ptr<float>();
  a.state_out = ds0.data_ptr<float>();
  check(kernels::delta_chunk_backward(
            a, c10::cuda::getCurrentCUDAStream(du.device().index()).stream()),
        "backward");
  return {du_total, ds_after, ds0};
}
#endif

class DeltaChunkFunction : public torch::autograd::Function<DeltaChunkFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const torch::Tensor& u0_in,
                               const torch::Tensor& w_in, const torch::Tensor& kt_in,
                               const torch::Tensor& decay_in, const torch::Tensor& s0_in,
                               bool use_kernel) {
    auto u0 = u0_in.contiguous(), w = w_in.contiguous(), kt = kt_in.contiguous();
    auto decay = decay_in.contiguous(), s0 = s0_in.contiguous();
    Loop loop;
#ifdef MHLA_WITH_CUDA_KERNELS
    if (use_kernel) loop = forward_kernel(u0, w, kt, decay, s0);
#endif
    if (!use_kernel) loop = forward_reference(u0, w, kt, decay, s0);
    ctx->save_for_backward({w, kt, decay, loop.per_chunk_a, loop.per_chunk_b});
    ctx->saved_data["kernel"] = use_kernel;
    return {loop.per_chunk_a, loop.per_chunk_b, loop.last};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &w = saved[0], &kt = saved[1], &decay = saved[2], &states = saved[3], &u = saved[4];
    const bool use_kernel = ctx->saved_data["kernel"].toBool();
    auto or_zeros = [](const torch::Tensor& g, const torch::Tensor& like) {
      return g.defined() ? g.contiguous() : torch::zeros_like(like);
    };
    auto dstates = or_zeros(grads[0], states), du = or_zeros(grads[1], u);
    auto dfinal = grads[2].defined() ? grads[2].contiguous()
                                     : torch::zeros({states.size(0), states.size(1), states.size(3),
                                                     states.size(4)},
                                                    states.options());
    Loop loop;
#ifdef MHLA_WITH_CUDA_KERNELS
    if (use_kernel) loop = backward_kernel(du, dstates, dfinal, w, kt, decay);
#endif
    if (!use_kernel) loop = backward_reference(du, dstates, dfinal, w, kt, decay);
    const auto& du_total = loop.per_chunk_a;
    const auto& ds_after = loop.per_chunk_b;
    // The per-chunk products, batched over every chunk.
    auto dw = -torch::matmul(du_total, states.transpose(-1, -2));
    auto dkt = torch::matmul(u, ds_after.transpose(-1, -2));
    auto ddecay = (states * ds_after).sum(-1);
    return {du_total, dw, dkt, ddecay, loop.last, torch::Tensor()};
  }
};

void check_inputs(const torch::Tensor& u0, const torch::Tensor& w, const torch::Tensor& kt,
                  const torch::Tensor& decay, const torch::Tensor& s0) {
  TORCH_CHECK(u0.dim() == 5 && w.dim() == 5 && kt.sizes() == w.sizes(),
              "delta chunk recurrence: u0 [B, H, n, C, Dv], w and kt [B, H, n, C, Dk]");
  TORCH_CHECK(u0.sizes().slice(0, 4) == w.sizes().slice(0, 4),
              "delta chunk recurrence: u0 and w differ in B, H, n or C");
  TORCH_CHECK(decay.dim() == 4 && decay.sizes().slice(0, 3) == w.sizes().slice(0, 3) &&
                  decay.size(3) == w.size(4),
              "delta chunk recurrence: decay must be [B, H, n, Dk]");
  TORCH_CHECK(s0.dim() == 4 && s0.size(0) == w.size(0) && s0.size(1) == w.size(1) &&
                  s0.size(2) == w.size(4) && s0.size(3) == u0.size(4),
              "delta chunk recurrence: s0 must be [B, H, Dk, Dv]");
  for (const auto* t : {&w, &kt, &decay, &s0}) {
    TORCH_CHECK(t->scalar_type() == u0.scalar_type() && t->device() == u0.device(),
                "delta chunk recurrence: inputs differ in dtype or device");
  }
}

DeltaChunkStates run(const torch::Tensor& u0, const torch::Tensor& w, const torch::Tensor& kt,
                     const torch::Tensor& decay, const torch::Tensor& s0, bool use_kernel) {
  check_inputs(u0, w, kt, decay, s0);
  auto out = DeltaChunkFunction::apply(u0, w, kt, decay, s0, use_kernel);
  return {out[0], out[1], out[2]};
}

}  // namespace

bool delta_chunk_recurrence_uses_kernel(const torch::Tensor& u0, const torch::Tensor& w) {
#ifdef MHLA_WITH_CUDA_KERNELS
  return u0.is_cuda() && u0.scalar_type() == torch::kFloat32 && w.dim() == 5 &&
         w.size(4) <= mhla_kernels::kDeltaChunkMaxKeyDim && w.size(4) % 4 == 0 &&
         w.size(3) <= mhla_kernels::kDeltaChunkMaxChunk;
#else
  (void)u0;
  (void)w;
  return false;
#endif
}

DeltaChunkStates delta_chunk_recurrence(const torch::Tensor& u0, const torch::Tensor& w,
                                        const torch::Tensor& kt, const torch::Tensor& decay,
                                        const torch::Tensor& s0) {
  return run(u0, w, kt, decay, s0, delta_chunk_recurrence_uses_kernel(u0, w));
}

DeltaChunkStates delta_chunk_recurrence_reference(const torch::Tensor& u0, const torch::Tensor& w,
                                                  const torch::Tensor& kt,
                                                  const torch::Tensor& decay,
                                                  const torch::Tensor& s0) {
  return run(u0, w, kt, decay, s0, false);
}

}  // namespace mhla
