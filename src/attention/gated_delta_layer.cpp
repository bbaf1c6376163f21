#include "attention/gated_delta_layer.h"

#include <cmath>

#include "attention/gated_delta.h"
#include "attention/gated_delta_fused.h"
#include "attention/gated_delta_decode.h"
#include "attention/gated_rms_norm.h"
#include "attention/registrations.h"
#include "attention/short_conv.h"

namespace mhla {

GatedDeltaLayerImpl::GatedDeltaLayerImpl(const AttentionSpec& spec, const AttentionType& type,
                                         bool per_key_gate)
    : AttentionLayerImpl(spec, type), per_key_gate_(per_key_gate) {
  const int64_t dim = spec.dim, heads = spec.heads, head_dim = dim / heads;
  const int64_t gates = per_key_gate ? dim : heads;  // one per head, or per key dim of each head
  conv_ = register_module(
      "conv",
      torch::nn::Conv1d(
          torch::nn::Conv1dOptions(3 * dim, 3 * dim, kConvWidth).groups(3 * dim).bias(false)));
  beta_proj_ = register_module("beta_proj", Linear(dim, heads));
  decay_proj_ =
      register_module("decay_proj", Linear(torch::nn::LinearOptions(dim, gates).bias(false)));
  out_gate_proj_ = register_module("out_gate_proj", Linear(dim, dim));
  torch::NoGradGuard no_grad;
  // fla's init: A ~ U(0, 16) (A_log = log A), dt = exp(U(log 1e-3, log 0.1)) >= 1e-4 and
  // dt_bias = softplus^{-1}(dt). Both are exempt from weight decay (1-D).
  a_log_ = register_parameter("A_log", torch::empty({heads}).uniform_(1e-4, 16.0).log());
  auto dt =
      torch::exp(torch::empty({gates}).uniform_(std::log(1e-3), std::log(0.1))).clamp_min(1e-4);
  dt_bias_ = register_parameter("dt_bias", dt + torch::log(-torch::expm1(-dt)));
  out_norm_weight_ = register_parameter("out_norm_weight", torch::ones({head_dim}));
}

OpArgs GatedDeltaLayerImpl::decay_args(const torch::Tensor& x) {
  const auto b = x.size(0), n = x.size(1);
  const int64_t heads = spec().heads, head_dim = spec().dim / heads;
  OpArgs args;
  args.causal = true;
  args.beta = torch::sigmoid(beta_proj_->forward(x).to(torch::kFloat32));  // [B, N, H]
  auto decay_in = decay_proj_->forward(x).to(torch::kFloat32) + dt_bias_;
  auto rate = torch::exp(a_log_);
  if (per_key_gate_) {
    args.gate = -rate.view({heads, 1}) *
                torch::softplus(decay_in).view({b, n, heads, head_dim});  // [B, N, H, Dk]
  } else {
    args.gate = -rate * torch::softplus(decay_in);  // [B, N, H]
  }
  return args;
}

std::pair<torch::Tensor, torch::Tensor> GatedDeltaLayerImpl::direction(
    const torch::Tensor& joint, const OpArgs& args, const torch::Tensor& out_gate, bool reversed) {
  // The reference backend keeps the whole layer in ATen ops (the GPU tests' oracle).
  const bool reference = spec().config.backend == "reference";
  auto [q, k, v] = reference ? short_conv_qkv_reference(joint, conv_->weight, spec().heads, reversed)
                             : short_conv_qkv(joint, conv_->weight, spec().heads, reversed);
  auto out = backend_for(joint.device())(q, k, v, args);
  if (reversed) out = out.flip({1});
  return {gated_output(out, out_gate), v};
}

torch::Tensor GatedDeltaLayerImpl::gated_output(const torch::Tensor& out,
                                                const torch::Tensor& out_gate) {
  return spec().config.backend == "reference"
             ? gated_rms_norm_reference(out, out_gate, out_norm_weight_, 1e-6)
             : gated_rms_norm(out, out_gate, out_norm_weight_, 1e-6);
}

torch::Tensor GatedDeltaLayerImpl::step(const torch::Tensor& x, DecodeState& state) {
  if (!spec().causal) fail("gated DeltaNet: decoding needs a causal layer");
  const auto b = x.size(0);
  const int64_t dim = spec().dim, heads = spec().heads, head_dim = dim / heads;
  auto row = project_joint_qkv(x);  // [B, 1, 3 dim]
  if (state.tensors.empty()) {
    state.tensors = {
        torch::zeros({b, kConvWidth - 1, 3 * dim}, row.options()),
        torch::zeros({b, heads, head_dim, head_dim},
                     row.options().dtype(row.scalar_type() == torch::kFloat64 ? torch::kFloat64
                                                                              : torch::kFloat32))};
  }
  auto window = torch::cat({state.tensors[0], row}, 1);  // [B, width, 3 dim]
  // The depthwise conv at the newest position: sum over the window of weight[c, 0, j] x[j, c].
  auto conv_out = (window * conv_->weight.squeeze(1).t().unsqueeze(0)).sum(1, /*keepdim=*/true);
  state.tensors[0] = window.narrow(1, 1, kConvWidth - 1);
  auto [q, k, v] = activate_conv_qkv(conv_out, heads);
  auto args = decay_args(x);
  auto o = delta_rule_decode(state.tensors[1], q.squeeze(1), k.squeeze(1), v.squeeze(1),
                             args.beta.squeeze(1), args.gate.squeeze(1),
                             1.0 / std::sqrt(static_cast<double>(head_dim)));
  ++state.position;
  auto out_gate = out_gate_proj_->forward(x).view({b, 1, heads, head_dim});
  return finish(x, gated_output(o.unsqueeze(1), out_gate).reshape({b, 1, dim}),
                v.reshape({b, 1, dim}));
}

torch::Tensor GatedDeltaLayerImpl::forward(const torch::Tensor& x) {
  const auto b = x.size(0), n = x.size(1);
  const int64_t dim = spec().dim, heads = spec().heads;
  auto joint = project_joint_qkv(x);  // [B, N, 3 dim]: q, k, v parts
  auto args = decay_args(x);
  auto out_gate = out_gate_proj_->forward(x).view({b, n, heads, dim / heads});
  auto [out, v] = direction(joint, args, out_gate, /*reversed=*/false);
  if (!spec().causal) {
    OpArgs back = args;  // the decays of the reversed sequence
    back.beta = args.beta.flip({1});
    back.gate = args.gate.flip({1});
    out = out + direction(joint, back, out_gate, /*reversed=*/true).first;
  }
  return finish(x, out.reshape({b, n, dim}), v.reshape({b, n, dim}));
}

namespace {

torch::Tensor delta_rule_op(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                            const OpArgs& args, DeltaCarry carry) {
  TORCH_CHECK(args.causal, "delta rule ops are causal; bidirectional layers run two scans");
  TORCH_CHECK(args.beta.defined() && args.gate.defined(), "delta rule ops need beta and gate");
  const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(3)));
  if (carry == DeltaCarry::kernel && gated_delta_fused_takes(q, k, v, args.gate)) {
    return gated_delta_fused(q, k, v, args.beta, args.gate, /*initial_state=*/{}, scale).out;
  }
  return delta_rule_chunked(q, k, v, args.beta, args.gate, /*initial_state=*/{},
                            1.0 / std::sqrt(static_cast<double>(q.size(3))), /*chunk=*/64, carry)
      .out;
}

AttentionType delta_rule_type(bool per_key_gate) {
  AttentionType type;
  type.unit_qk = true;  // the layer L2-normalizes q and k before the op
  type.description =
      per_key_gate ? "KDA: gated delta rule with one decay per key dimension (chunk 64)"
                   : "gated DeltaNet: delta rule with one decay per head and token (chunk 64)";
  type.causal_modes = {true};
  type.backends["reference"] = [](const torch::Tensor& q, const torch::Tensor& k,
                                  const torch::Tensor& v, const OpArgs& args) {
    return delta_rule_op(q, k, v, args, DeltaCarry::reference);
  };
#ifdef MHLA_WITH_CUDA_KERNELS
  // Gated DeltaNet and KDA in bf16/fp16 with Dk = Dv in {64, 128}: the fused chunked kernels
  // (gated_delta_fused.h; at T = 2,048, B*T = 32,768, D = 128 forward+backward takes 2.66 ms for
  // gated DeltaNet and 4.12 ms for KDA, against 17.4 and 97.5 ms for the batched path). Other
  // shapes and fp32: the chunked form with the state carried by the CUDA kernels and the rest as
  // batched LibTorch ops. Both checked against the references on the H200 (GPU tests, memcheck
  // clean; experiments/gated_delta.md), so `auto` picks this backend on a GPU.
  type.backends["cuda"] = [](const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                             const OpArgs& args) {
    return delta_rule_op(q, k, v, args, DeltaCarry::kernel);
  };
  type.gpu_preference = {"cuda"};
#endif
  type.make_layer = [per_key_gate](const AttentionSpec& spec, const AttentionType& t) {
    return std::make_shared<GatedDeltaLayerImpl>(spec, t, per_key_gate);
  };
  type.make_args = [per_key_gate](const OpShape& s, const torch::TensorOptions& options) {
    // q and k arrive L2-normalized (unit_qk), as from the layer; beta anywhere in (0, 1).
    OpArgs args;
    args.causal = true;
    auto f32 = options.dtype(torch::kFloat32);
    args.beta = torch::rand({s.batch, s.tokens, s.heads}, f32);
    args.gate = per_key_gate ? -torch::rand({s.batch, s.tokens, s.heads, s.head_dim}, f32)
                             : -torch::rand({s.batch, s.tokens, s.heads}, f32);
    return args;
  };
  return type;
}

}  // namespace

void register_gated_delta_attention(Registry<AttentionType>& registry) {
  registry.add("gated_deltanet", delta_rule_type(/*per_key_gate=*/false));
  registry.add("kda", delta_rule_type(/*per_key_gate=*/true));
}

}  // namespace mhla
