#pragma once
// Pre-norm transformer block: x + drop_path(attn(LN(x))), then x + drop_path(mlp(LN(x))).
#include <memory>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "models/gelu_mlp.h"
#include "models/linear.h"

#include "attention/attention_layer.h"
#include "models/layer_norm.h"

namespace mhla {

// The config's `model.mlp`: GELU (exact erf form), GELU in its tanh form (fused into the matrix
// products on CUDA: models/gelu_mlp.h), or SwiGLU.
enum class MlpKind { gelu, gelu_tanh, swiglu };
MlpKind mlp_kind(const std::string& name);

// fc2(gelu(fc1(x))).
class MlpImpl : public torch::nn::Module {
 public:
  MlpImpl(int64_t dim, int64_t hidden, bool bias = true, GeluForm form = GeluForm::exact);
  torch::Tensor forward(const torch::Tensor& x);

 private:
  Linear fc1_{nullptr}, fc2_{nullptr};
  GeluForm form_;
};
TORCH_MODULE(Mlp);

// SwiGLU MLP: w2(silu(w1 x) * w3 x).
class SwiGluMlpImpl : public torch::nn::Module {
 public:
  SwiGluMlpImpl(int64_t dim, int64_t hidden);
  torch::Tensor forward(const torch::Tensor& x);

 private:
  Linear w1_{nullptr}, w2_{nullptr}, w3_{nullptr};
};
TORCH_MODULE(SwiGluMlp);

class TransformerBlockImpl : public torch::nn::Module {
 public:
  TransformerBlockImpl(std::shared_ptr<AttentionLayerImpl> attention, int64_t dim,
                       int64_t mlp_hidden, double drop_path_rate, MlpKind mlp = MlpKind::gelu,
                       bool bias = true);
  AttentionLayerImpl& attention() { return *attention_; }
  torch::Tensor forward(const torch::Tensor& x);
  // The same block in a chain: takes (x, norm1(x)) and returns (out, next_norm(out)), with both
  // residual adds fused into the norm that follows them (the attention's into norm2, the MLP's
  // into next_norm: the next block's norm1 or the model's final norm). Values equal forward's.
  std::pair<torch::Tensor, torch::Tensor> forward_normed(const torch::Tensor& x,
                                                         const torch::Tensor& normed,
                                                         LayerNormImpl& next_norm);
  LayerNormImpl& norm1() { return *norm1_; }
  // One decoded token, x [B, 1, dim] (causal attention layers only).
  torch::Tensor step(const torch::Tensor& x, DecodeState& state);

 private:
  LayerNorm norm1_{nullptr}, norm2_{nullptr};
  std::shared_ptr<AttentionLayerImpl> attention_;
  torch::nn::AnyModule mlp_;
  double drop_path_rate_;
};
TORCH_MODULE(TransformerBlock);

// final_norm(x after every block), the blocks chained through forward_normed: each hands the
// next its input already normalized (residual add + norm fused). Needs at least one block.
torch::Tensor forward_blocks(std::vector<TransformerBlock>& blocks, torch::Tensor x,
                             LayerNormImpl& final_norm);

}  // namespace mhla
