#include "attention/gated_delta_fused.h"

#include "core/error.h"

#ifdef MHLA_WITH_CUDA_KERNELS
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "attention/kernel_views.h"
#include "gated_delta/chunk_fused.h"
#endif

namespace mhla {

bool gated_delta_fused_takes(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                             const torch::Tensor& g) {
#ifdef MHLA_WITH_CUDA_KERNELS
  const auto type = v.scalar_type();
  const bool gate_shape = g.dim() == 3 || (g.dim() == 4 && g.size(3) == q.size(3));
  return q.is_cuda() && (type == torch::kBFloat16 || type == torch::kFloat16) && q.dim() == 4 &&
         k.sizes() == q.sizes() && v.dim() == 4 && gate_shape &&
         mhla_kernels::gated_delta_fused_supports(static_cast<int>(q.size(3)),
                                                  static_cast<int>(v.size(3))) &&
         q.size(1) > 0 && q.size(0) * q.size(2) <= 65535;
#else
  (void)q, (void)k, (void)v, (void)g;
  return false;
#endif
}

#ifdef MHLA_WITH_CUDA_KERNELS
namespace {

namespace kernels = mhla_kernels;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The arguments every pass shares: shapes and inputs.
kernels::GatedDeltaArgs base_args(const torch::Tensor& q, const torch::Tensor& k,
                                  const torch::Tensor& v, const torch::Tensor& beta,
                                  const torch::Tensor& g, double scale) {
  kernels::GatedDeltaArgs a;
  a.dtype = kernel_dtype(v.scalar_type());
  a.batch = static_cast<int>(q.size(0)), a.tokens = static_cast<int>(q.size(1));
  a.heads = static_cast<int>(q.size(2)), a.head_dim = static_cast<int>(q.size(3));
  a.scale = static_cast<float>(scale);
  a.q = q.data_ptr(), a.k = k.data_ptr(), a.v = v.data_ptr();
  a.beta = beta.data_ptr<float>(), a.gate = g.data_ptr<float>();
  a.per_key_gate = g.dim() == 4;
  return a;
}

// The fp32 scratch a pipelined walk carries its state in (gated_delta_walk_segments), when the
// kernels will pipeline; kept alive by the caller until the launches are queued (the stream
// orders its reuse).
torch::Tensor walk_scratch_for(kernels::GatedDeltaArgs& a, const torch::Tensor& v) {
  if (kernels::gated_delta_walk_segments(a) <= 1) return {};
  auto scratch = torch::empty({2, v.size(0) * v.size(2), v.size(3), v.size(3)},
                              v.options().dtype(torch::kFloat32));
  a.walk_scratch = scratch.data_ptr<float>();
  return scratch;
}

class GatedDeltaFusedFunction : public torch::autograd::Function<GatedDeltaFusedFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const torch::Tensor& q_in,
                               const torch::Tensor& k_in, const torch::Tensor& v_in,
                               const torch::Tensor& beta_in, const torch::Tensor& g_in,
                               const torch::Tensor& initial_state_in, double scale) {
    c10::cuda::CUDAGuard on_device(v_in.device());
    const auto type = v_in.scalar_type();
    auto q = q_in.to(type).contiguous(), k = k_in.to(type).contiguous();
    auto v = v_in.contiguous();
    auto beta = beta_in.to(torch::kFloat32).contiguous();
    auto g = g_in.to(torch::kFloat32).contiguous();
    // An empty tensor stands for "no initial state" (autograd functions take no undefined inputs).
    auto h0 = initial_state_in.numel() > 0 ? initial_state_in.to(torch::kFloat32).contiguous()
                                           : torch::Tensor();
    const auto b = q.size(0), t = q.size(1), h = q.size(2), d = q.size(3);
    const int64_t chunks = kernels::gated_delta_chunks(static_cast<int>(t));
    const int64_t c = kernels::kGatedDeltaChunk;
    auto f32 = v.options().dtype(torch::kFloat32);
    const bool per_key = g.dim() == 4;
    auto gate_sums = per_key ? torch::empty({b * h, chunks * c, d}, f32)
                             : torch::empty({b * h, chunks * c}, f32);
    auto w = torch::empty({b * h, chunks, c, d}, v.options());
    auto u0 = torch::empty_like(w), u = torch::empty_like(w);
    auto t_inverse = torch::empty({b * h, chunks, c, c}, v.options());
    auto states = torch::empty({b * h, chunks, d, d}, v.options());
    auto out = torch::empty_like(v);
    auto final_state = torch::empty({b, h, d, d}, f32);
    auto a = base_args(q, k, v, beta, g, scale);
    a.initial_state = h0.defined() ? h0.data_ptr<float>() : nullptr;
    a.gate_sums = gate_sums.data_ptr<float>();
    a.w = w.data_ptr(), a.u0 = u0.data_ptr(), a.u = u.data_ptr(), a.states = states.data_ptr();
    a.t_inverse = t_inverse.data_ptr();
    a.out = out.data_ptr(), a.final_state = final_state.data_ptr<float>();
    // The decayed causal scores P (the backward's state walk reads them); KDA's gated operands
    // and key scores (empty for gated DeltaNet: the kernels form them inline).
    auto scores = torch::empty_like(t_inverse);
    a.scores = scores.data_ptr();
    torch::Tensor q_gated, k_to_end, key_scores;
    if (per_key) {
      q_gated = torch::empty_like(w), k_to_end = torch::empty_like(w);
      key_scores = torch::empty_like(t_inverse);
      a.q_gated = q_gated.data_ptr(), a.k_to_end = k_to_end.data_ptr();
      a.key_scores = key_scores.data_ptr();
    } else {
      q_gated = k_to_end = key_scores = torch::empty({0}, v.options());
    }
    const auto scratch = walk_scratch_for(a, v);
    check_launch(
        kernels::gated_delta_forward(a,
                                     c10::cuda::getCurrentCUDAStream(v.device().index()).stream()),
        per_key ? "KDA forward (fused kernels)" : "gated DeltaNet forward (fused kernels)");
    ctx->save_for_backward({q, k, v, beta, g, gate_sums, w, u0, u, states, t_inverse, q_gated,
                            k_to_end, scores, key_scores});
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["has_initial_state"] = h0.defined();
    remember_input_dtypes(ctx, q_in, k_in);
    ctx->saved_data["beta_dtype"] = static_cast<int64_t>(beta_in.scalar_type());
    ctx->saved_data["g_dtype"] = static_cast<int64_t>(g_in.scalar_type());
    return {out, final_state};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto s = ctx->get_saved_variables();
    const auto &q = s[0], &k = s[1], &v = s[2], &beta = s[3], &g = s[4];
    c10::cuda::CUDAGuard on_device(v.device());
    auto d_out =
        grads[0].defined() ? grads[0].to(v.scalar_type()).contiguous() : torch::zeros_like(v);
    auto dfinal = grads[1].defined() ? grads[1].to(torch::kFloat32).contiguous() : torch::Tensor();
    const bool has_h0 = ctx->saved_data["has_initial_state"].toBool();
    auto a = base_args(q, k, v, beta, g, ctx->saved_data["scale"].toDouble());
    a.gate_sums = s[5].data_ptr<float>();
    a.w = s[6].data_ptr(), a.u0 = s[7].data_ptr(), a.u = s[8].data_ptr();
    a.states = s[9].data_ptr();
    a.t_inverse = s[10].data_ptr();
    a.scores = s[13].data_ptr();
    const bool per_key = a.per_key_gate;
    if (per_key) {
      a.q_gated = s[11].data_ptr(), a.k_to_end = s[12].data_ptr();
      a.key_scores = s[14].data_ptr();
    }
    a.d_out = d_out.data_ptr();
    a.final_state_grad = dfinal.defined() ? dfinal.data_ptr<float>() : nullptr;
    auto f32 = v.options().dtype(torch::kFloat32);
    auto du = torch::empty_like(s[6]), state_grads = torch::empty_like(s[9]);
    torch::Tensor dw, dk_partial, dgate_partial;  // KDA's per-chunk gradients pass them on
    if (per_key) {
      dw = torch::empty_like(s[6]), dk_partial = torch::empty(s[6].sizes(), f32);
      dgate_partial = torch::empty_like(s[5]);
      a.dw = dw.data_ptr(), a.dk_partial = dk_partial.data_ptr<float>();
      a.dgate_partial = dgate_partial.data_ptr<float>();
    }
    auto dq = torch::empty_like(q), dk = torch::empty_like(k), dv = torch::empty_like(v);
    auto dbeta = torch::empty_like(beta), dgate = torch::empty_like(g);
    torch::Tensor dh0;
    if (has_h0) dh0 = torch::empty({q.size(0), q.size(2), q.size(3), v.size(3)}, f32);
    a.du = du.data_ptr();
    a.state_grads = state_grads.data_ptr();
    a.dq = dq.data_ptr(), a.dk = dk.data_ptr(), a.dv = dv.data_ptr();
    a.dbeta = dbeta.data_ptr<float>(), a.dgate = dgate.data_ptr<float>();
    a.initial_state_grad = has_h0 ? dh0.data_ptr<float>() : nullptr;
    const auto scratch = walk_scratch_for(a, v);
    check_launch(
        kernels::gated_delta_backward(a,
                                      c10::cuda::getCurrentCUDAStream(v.device().index()).stream()),
        per_key ? "KDA backward (fused kernels)" : "gated DeltaNet backward (fused kernels)");
    const auto [q_type, k_type] = input_dtypes(ctx);
    const auto beta_type = static_cast<torch::ScalarType>(ctx->saved_data["beta_dtype"].toInt());
    const auto g_type = static_cast<torch::ScalarType>(ctx->saved_data["g_dtype"].toInt());
    return {dq.to(q_type), dk.to(k_type),  dv, dbeta.to(beta_type), dgate.to(g_type),
            dh0,           torch::Tensor()};
  }
};

}  // namespace
#endif

DeltaRuleOutput gated_delta_fused(const torch::Tensor& q, const torch::Tensor& k,
                                  const torch::Tensor& v, const torch::Tensor& beta,
                                  const torch::Tensor& g, const torch::Tensor& initial_state,
                                  double scale) {
  if (!gated_delta_fused_takes(q, k, v, g)) {
    fail(
        "gated DeltaNet (fused kernels): needs CUDA tensors, v in bf16 or fp16, g [B, T, H] (or "
        "[B, T, H, Dk] for KDA) and Dk == Dv in {{64, 128}}; got q {}, v {} ({}), g {}",
        c10::str(q.sizes()), c10::str(v.sizes()), c10::toString(v.scalar_type()),
        c10::str(g.sizes()));
  }
  TORCH_CHECK(beta.sizes() == q.sizes().slice(0, 3) &&
                  g.sizes().slice(0, 3) == q.sizes().slice(0, 3) && v.size(1) == q.size(1) &&
                  v.size(2) == q.size(2) && v.size(0) == q.size(0),
              "gated DeltaNet (fused kernels): q, v, beta or g disagree in B, T or H");
  if (initial_state.defined()) {
    TORCH_CHECK(
        initial_state.sizes() == torch::IntArrayRef({q.size(0), q.size(2), q.size(3), v.size(3)}),
        "gated DeltaNet (fused kernels): initial_state must be [B, H, Dk, Dv]");
  }
#ifdef MHLA_WITH_CUDA_KERNELS
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  check_same_device(
      "gated DeltaNet (fused kernels)", v,
      {{"q", q}, {"k", k}, {"beta", beta}, {"g", g}, {"initial_state", initial_state}});
  auto outs = GatedDeltaFusedFunction::apply(
      q, k, v, beta, g,
      initial_state.defined() ? initial_state
                              : torch::empty({0}, v.options().dtype(torch::kFloat32)),
      scale);
  return {outs[0], outs[1]};
#else
  return {};
#endif
}

}  // namespace mhla
