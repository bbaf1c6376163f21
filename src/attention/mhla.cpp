#include "attention/mhla.h"

#include <cmath>

#include "attention/causal_linear.h"
#include "attention/gated_rms_norm.h"
#include "attention/block_linear_cuda.h"
#include "attention/registrations.h"
#include "core/error.h"

namespace mhla {

torch::Tensor mhla_reference(const torch::Tensor& q, const torch::Tensor& k,
                             const torch::Tensor& v, const OpArgs& args) {
  if (args.causal) {
    // Blocks are 64-token chunks; args.mixing is the learned lower-triangular M x M matrix.
    TORCH_CHECK(args.mixing.defined() && args.mixing.dim() == 2 &&
                    args.mixing.size(0) == args.mixing.size(1),
                "mhla: causal mixing must be square");
    return causal_mhla_reference(q, k, v, args.mixing);
  }
  const auto n = q.size(1), m = args.blocks;
  TORCH_CHECK(m >= 1 && n % m == 0, "mhla: N = ", n, " is not a multiple of blocks = ", m);
  TORCH_CHECK(args.mixing.defined() && args.mixing.size(0) == m && args.mixing.size(1) == m,
              "mhla: mixing must be [blocks, blocks]");
  return block_linear_attention(q, k, v, args.mixing, m);
}

torch::Tensor mhla_initial_mixing(const std::string& init, int64_t tiles_h, int64_t tiles_w) {
  const int64_t m = tiles_h * tiles_w;
  if (init == "uniform") return torch::full({m, m}, 1.0 / static_cast<double>(m));
  if (init != "locality") fail("mhla: unknown mixing init '{}' (locality, uniform)", init);
  auto mixing = torch::ones({m, m}, torch::kFloat64);
  auto acc = mixing.accessor<double, 2>();
  for (int64_t i = 0; i < m; ++i) {
    double max_distance = 0;
    std::vector<double> distance(m);
    for (int64_t j = 0; j < m; ++j) {
      const double dy = static_cast<double>(i / tiles_w - j / tiles_w);
      const double dx = static_cast<double>(i % tiles_w - j % tiles_w);
      distance[j] = std::sqrt(dx * dx + dy * dy);
      max_distance = std::max(max_distance, distance[j]);
    }
    double row_sum = 0;
    for (int64_t j = 0; j < m; ++j) {
      acc[i][j] = max_distance > 0 ? 1.0 - distance[j] / max_distance : 1.0;
      row_sum += acc[i][j];
    }
    for (int64_t j = 0; j < m; ++j) acc[i][j] /= row_sum;
  }
  return mixing.to(torch::kFloat32);
}

MhlaLayerImpl::MhlaLayerImpl(const AttentionSpec& spec, const AttentionType& type)
    : AttentionLayerImpl(spec, type) {
  if (!spec.causal && spec.layout.blocks() != spec.config.blocks) {
    fail("{}: attention.blocks = {} but the token layout has {} tiles", spec.where,
         spec.config.blocks, spec.layout.blocks());
  }
  if (spec.causal) {
    // Causal: M blocks of 64 tokens, lower-triangular mixing, uniform rows 1/(i+1).
    const int64_t m = spec.config.blocks;
    auto rows = torch::arange(1, m + 1, torch::kFloat32).reciprocal().unsqueeze(1);
    mixing_ = register_parameter("mixing", (rows * torch::ones({m, m})).tril());
    out_norm_weight_ = register_parameter("out_norm_weight", torch::ones({spec.dim / spec.heads}));
    out_gate_ = register_module("out_gate_proj", Linear(spec.dim, spec.dim));
  } else {
    mixing_ = register_parameter(
        "mixing", mhla_initial_mixing(spec.config.init, spec.layout.tiles_h, spec.layout.tiles_w));
  }
}

void MhlaLayerImpl::project_parameters() {
  torch::NoGradGuard no_grad;
  if (spec().causal) {
    mixing_.clamp_(1e-5, 1.0).tril_();  // the upper triangle stays exactly zero
  } else {
    mixing_.clamp_(0.0, 1.0);
  }
}

torch::Tensor MhlaLayerImpl::causal_output(const torch::Tensor& x, const torch::Tensor& out,
                                           const torch::Tensor& v) {
  // Causal MHLA: an output RMSNorm (per head) times a swish gate after the op.
  const auto b = x.size(0), n = x.size(1);
  const int64_t heads = spec().heads, head_dim = spec().dim / heads;
  auto gate = out_gate_->forward(x).view({b, n, heads, head_dim});
  auto gated = gated_rms_norm(out, gate, out_norm_weight_, 1e-6);
  return finish(x, gated.reshape({b, n, spec().dim}), v.reshape({b, n, spec().dim}));
}

torch::Tensor MhlaLayerImpl::forward(const torch::Tensor& x) {
  if (!spec().causal) return AttentionLayerImpl::forward(x);
  auto [q, k, v] = project_qkv(x);
  return causal_output(x, backend_for(x.device())(q, k, v, op_args()), v);
}

torch::Tensor MhlaLayerImpl::step(const torch::Tensor& x, DecodeState& state) {
  auto [q, k, v] = project_qkv(x, state.position);
  auto out = decode_op(q, k, v, state);
  ++state.position;
  return causal_output(x, out, v);
}

OpArgs MhlaLayerImpl::op_args() const {
  OpArgs args = AttentionLayerImpl::op_args();
  args.blocks = spec().layout.blocks();
  args.mixing = mixing_;
  return args;
}

void register_mhla_attention(Registry<AttentionType>& registry) {
  AttentionType type;
  type.description =
      "multi-head linear attention: token blocks (2-D tiles) mixed by a learned M x M matrix";
  type.uses_blocks = true;
  type.normalizes_qk = true;
  type.causal_modes = {false, true};
  type.decode = [](const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                   const OpArgs& args, DecodeState& state) {
    return causal_mhla_decode(q, k, v, args.mixing, state);
  };
#ifdef MHLA_WITH_CUDA_KERNELS
  type.backends["cuda"] = mhla_cuda;  // fused kernels, bidirectional and causal
  type.gpu_preference = {"cuda"};
  type.backends["cuda_dense"] = mhla_cuda_dense;  // dense masked form, short sequences
#endif
  type.backends["reference"] = mhla_reference;
  type.make_layer = [](const AttentionSpec& spec, const AttentionType& t) {
    return std::make_shared<MhlaLayerImpl>(spec, t);
  };
  type.make_args = [](const OpShape& shape, const torch::TensorOptions& options) {
    OpArgs args;
    args.causal = shape.causal;
    args.blocks = shape.blocks;
    args.mixing = torch::rand({shape.blocks, shape.blocks}, options.dtype(torch::kFloat32));
    if (shape.causal) args.mixing = args.mixing.tril() + 1e-5;
    return args;
  };
  registry.add("mhla", std::move(type));
}

}  // namespace mhla
