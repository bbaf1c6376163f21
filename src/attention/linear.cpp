#include "attention/linear.h"

#include "attention/causal_linear.h"
#include "attention/block_linear_cuda.h"
#include "attention/registrations.h"
#include "core/error.h"

namespace mhla {

torch::Tensor linear_attention_reference(const torch::Tensor& q, const torch::Tensor& k,
                                         const torch::Tensor& v, const OpArgs& args) {
  if (args.causal) return causal_linear_attention_reference(q, k, v);
  return block_linear_attention(q, k, v, /*mixing=*/{}, /*blocks=*/1);
}

void register_linear_attention(Registry<AttentionType>& registry) {
  AttentionType type;
  type.description = "linear attention, phi = relu(RMSNorm(x)) + 1e-6, normalized output";
  type.normalizes_qk = true;
  type.causal_modes = {false, true};
  type.decode = [](const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                   const OpArgs&, DecodeState& state) { return causal_linear_decode(q, k, v, state); };
#ifdef MHLA_WITH_CUDA_KERNELS
  type.backends["cuda"] = linear_attention_cuda;  // fused kernels, bidirectional and causal
  type.gpu_preference = {"cuda"};
  type.backends["cuda_dense"] = linear_attention_cuda_dense;  // dense masked form, short sequences
#endif
  type.backends["reference"] = linear_attention_reference;
  type.make_layer = [](const AttentionSpec& spec, const AttentionType& t) {
    return std::make_shared<AttentionLayerImpl>(spec, t);
  };
  type.make_args = [](const OpShape& shape, const torch::TensorOptions&) {
    OpArgs args;
    args.causal = shape.causal;
    return args;
  };
  registry.add("linear", std::move(type));
}

}  // namespace mhla
