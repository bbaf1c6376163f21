#pragma once
// A full attention layer: QKV projection -> op (from the registry, backend chosen per device)
// -> optional CPE and output gate -> output projection. Attention types subclass it only to add
// their own parameters (MHLA: the block-mixing matrix) and the arguments they pass to the op.
#include <array>
#include <memory>
#include <string>

#include <torch/torch.h>

#include "models/linear.h"

#include "attention/attention_op.h"
#include "attention/token_layout.h"
#include "core/config.h"

namespace mhla {

struct AttentionType;

// Everything a layer is built from.
struct AttentionSpec {
  int64_t dim = 0;
  int64_t heads = 1;
  TokenLayout layout;
  bool causal = false;
  bool rotary = false;  // rotate q, k by position (types with uses_rotary)
  bool bias = true;     // biases in the q/k/v, output and gate projections
  AttentionConfig config;
  std::string where;  // config location of attention.backend, for errors
};

// Modules with parameters kept inside a set (e.g. MHLA mixing in [0, 1]) after each optimizer
// step implement this.
class ProjectedModule {
 public:
  virtual ~ProjectedModule() = default;
  virtual void project_parameters() = 0;
};

class AttentionLayerImpl : public torch::nn::Module, public ProjectedModule {
 public:
  AttentionLayerImpl(const AttentionSpec& spec, const AttentionType& type);

  // x: [B, N, dim] -> [B, N, dim]
  virtual torch::Tensor forward(const torch::Tensor& x);
  // Causal decoding: x [B, 1, dim] is the token at state.position; returns [B, 1, dim] and
  // advances the state. Equals forward() on the whole sequence, one position at a time.
  virtual torch::Tensor step(const torch::Tensor& x, DecodeState& state);
  void project_parameters() override {}

  const AttentionSpec& spec() const { return spec_; }

 protected:
  // Per-type arguments for the op (mixing matrix, blocks, ...).
  virtual OpArgs op_args() const;
  // x [B, N, dim] -> q, k, v, each [B, N, H, D] (views of one projection).
  std::array<torch::Tensor, 3> project_qkv(const torch::Tensor& x, int64_t first_position = 0);
  // x [B, N, dim] -> the joint projection [B, N, 3 dim] (q, k, v parts, no rotary).
  torch::Tensor project_joint_qkv(const torch::Tensor& x) { return qkv_->forward(x); }
  // The op's one-token step (the type's decode function), for step() implementations.
  torch::Tensor decode_op(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                          DecodeState& state) const;
  // The optional CPE (from v, [B, N, dim]) and output gate, then the output projection.
  torch::Tensor finish(const torch::Tensor& x, torch::Tensor out, const torch::Tensor& v);
  const OpFn& backend_for(const torch::Device& device);

 private:
  AttentionSpec spec_;
  const AttentionType& type_;
  Linear qkv_{nullptr}, proj_{nullptr}, gate_{nullptr};
  torch::nn::Conv2d cpe_{nullptr};
  const OpFn* cpu_backend_ = nullptr;
  const OpFn* cuda_backend_ = nullptr;
};

}  // namespace mhla
