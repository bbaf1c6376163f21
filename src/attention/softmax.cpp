#include "attention/softmax.h"

#include "attention/deterministic_flash_attention.h"
#include "attention/registrations.h"

namespace mhla {

torch::Tensor softmax_attention_reference(const torch::Tensor& q, const torch::Tensor& k,
                                          const torch::Tensor& v, const OpArgs& args) {
  // SDPA takes [B, H, N, D].
  auto qt = q.transpose(1, 2), kt = k.transpose(1, 2), vt = v.transpose(1, 2);
  if (deterministic_flash_takes(qt, kt, vt)) {  // train.deterministic: the ordered backward
    return deterministic_flash_attention(qt, kt, vt, args.causal).transpose(1, 2);
  }
  auto out = at::scaled_dot_product_attention(qt, kt, vt, /*attn_mask=*/{},
                                              /*dropout_p=*/0.0, args.causal);
  return out.transpose(1, 2);
}

namespace {

// KV cache: keys and values of every earlier token; the new query attends to all of them.
torch::Tensor softmax_decode(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                             const OpArgs&, DecodeState& state) {
  if (state.tensors.empty()) {
    state.tensors = {k, v};
  } else {
    state.tensors[0] = torch::cat({state.tensors[0], k}, 1);
    state.tensors[1] = torch::cat({state.tensors[1], v}, 1);
  }
  OpArgs all;
  all.causal = false;
  return softmax_attention_reference(q, state.tensors[0], state.tensors[1], all);
}

}  // namespace

void register_softmax_attention(Registry<AttentionType>& registry) {
  AttentionType type;
  type.description = "softmax attention, O(N^2) (PyTorch SDPA: flash / cuDNN / math)";
  type.causal_modes = {false, true};
  type.uses_rotary = true;
  type.decode = softmax_decode;
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
