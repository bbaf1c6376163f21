#include "attention/softmax.h"

#include "attention/registrations.h"

namespace mhla {

torch::Tensor softmax_attention_reference(const torch::Tensor& q, const torch::Tensor& k,
                                          const torch::Tensor& v, const OpArgs& args) {
  // SDPA takes [B, H, N, D].
  auto out = at::scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                              v.transpose(1, 2), /*attn_mask=*/{},
                                              /*dropout_p=*/0.0, args.causal);
  return out.transpose(1, 2);
}

void register_softmax_attention(Registry<AttentionType>& registry) {
  AttentionType type;
  type.description = "softmax attention, O(N^2) (PyTorch SDPA: flash / cuDNN / math)";
  type.causal_modes = {false, true};
  type.uses_rotary = true;
  type.backends["reference"] = softmax_attention_reference;
  type.make_layer = [](const AttentionSpec& spec, const AttentionType& t) {
    return std::make_shared<AttentionLayerImpl>(spec, t);
  };
  type.make_args = [](const OpShape& shape, const torch::TensorOptions&) {
    OpArgs args;
    args.causal = shape.causal;
    return args;
  };
  registry.add("softmax", std::move(type));
}

}  // namespace mhla
