#include "attention/attention_layer.h"

#include "attention/attention_type.h"
#include "attention/grid_depthwise_conv.h"
#include "attention/rotary.h"
#include "core/environment.h"

namespace mhla {

AttentionLayerImpl::AttentionLayerImpl(const AttentionSpec& spec, const AttentionType& type)
    : spec_(spec), type_(type) {
  TORCH_CHECK(spec.dim % spec.heads == 0, "heads must divide dim");
  auto linear = [&](int64_t in, int64_t out) {
    return Linear(torch::nn::LinearOptions(in, out).bias(spec.bias));
  };
  qkv_ = register_module("qkv", linear(spec.dim, 3 * spec.dim));
  proj_ = register_module("proj", linear(spec.dim, spec.dim));
  if (spec.config.gate) gate_ = register_module("gate", linear(spec.dim, spec.dim));
  if (spec.config.cpe) {
    if (!spec.layout.is_grid()) fail("{}: attention.cpe needs a 2-D token grid", spec.where);
    const auto k = spec.config.cpe_kernel;
    cpe_ = register_module(
        "cpe",
        torch::nn::Conv2d(
            torch::nn::Conv2dOptions(spec.dim, spec.dim, k).padding(k / 2).groups(spec.dim)));
  }
  // A backend this build lacks is an error at build time, not mid-run.
  if (spec.config.backend != "auto" && !type.backends.count(spec.config.backend)) {
    select_backend(spec.config.type, type, spec.config.backend, torch::kCUDA, spec.where,
                   spec.causal);
  }
}

const OpFn& AttentionLayerImpl::backend_for(const torch::Device& device) {
  const OpFn*& cached = device.is_cuda() ? cuda_backend_ : cpu_backend_;
  if (!cached) {
    cached = &select_backend(spec_.config.type, type_, spec_.config.backend, device, spec_.where,
                             spec_.causal);
  }
  return *cached;
}

OpArgs AttentionLayerImpl::op_args() const {
  OpArgs args;
  args.causal = spec_.causal;
  return args;
}

std::array<torch::Tensor, 3> AttentionLayerImpl::project_qkv(const torch::Tensor& x,
                                                             int64_t first_position) {
  const auto b = x.size(0), n = x.size(1);
  const auto h = spec_.heads, d = spec_.dim / spec_.heads;
  auto qkv = qkv_->forward(x).view({b, n, 3, h, d});
  const bool rotary = spec_.rotary && type_.uses_rotary;
  // Rotary: one kernel splits and rotates (and its backward writes the projection's gradient).
  // MHLA_FUSED_QKV_ROTARY=0: rotate q and k separately (the A/B baseline).
  static const bool fused_split = environment_switch("MHLA_FUSED_QKV_ROTARY", true);
  if (rotary && fused_split) return split_rotary_qkv(qkv, first_position);
  // unbind, not three selects: its backward writes the fused gradient once (stacking dq, dk,
  // dv), where each select's backward would fill a zero tensor of the whole projection.
  auto parts = qkv.unbind(2);
  if (rotary) {
    return {apply_rotary(parts[0], first_position), apply_rotary(parts[1], first_position),
            parts[2]};
  }
  return {parts[0], parts[1], parts[2]};
}

torch::Tensor AttentionLayerImpl::finish(const torch::Tensor& x, torch::Tensor out,
                                         const torch::Tensor& v) {
  if (cpe_) {
    // CPE: depthwise conv of v over the 2-D patch grid, added to the attention output; on the
    // tokens where they lie (block-major), without gathering them into a raster grid and back.
    out = grid_depthwise_conv_added(out, v, cpe_->weight, cpe_->bias, spec_.layout);
  }
  if (gate_) out = out * torch::sigmoid(gate_->forward(x));
  return proj_->forward(out);
}

torch::Tensor AttentionLayerImpl::forward(const torch::Tensor& x) {
  const auto b = x.size(0), n = x.size(1);
  auto [q, k, v] = project_qkv(x);
  auto out = backend_for(x.device())(q, k, v, op_args()).reshape({b, n, spec_.dim});
  return finish(x, out, v.reshape({b, n, spec_.dim}));
}

torch::Tensor AttentionLayerImpl::decode_op(const torch::Tensor& q, const torch::Tensor& k,
                                            const torch::Tensor& v, DecodeState& state) const {
  if (!spec_.causal) fail("attention type '{}': decoding needs a causal layer", spec_.config.type);
  if (!type_.decode) fail("attention type '{}' has no decoding step", spec_.config.type);
  return type_.decode(q, k, v, op_args(), state);
}

torch::Tensor AttentionLayerImpl::step(const torch::Tensor& x, DecodeState& state) {
  const auto b = x.size(0);
  auto [q, k, v] = project_qkv(x, state.position);
  auto out = decode_op(q, k, v, state).reshape({b, 1, spec_.dim});
  ++state.position;
  return finish(x, out, v.reshape({b, 1, spec_.dim}));
}

}  // namespace mhla
