#pragma once
// DiT (Peebles & Xie): patchify (patch 2) with a fixed 2-D sin-cos position embedding, timestep
// embedding (sinusoidal + MLP), class embedding with a null class for classifier-free guidance,
// adaLN-Zero blocks with registry attention (bidirectional; MHLA on 2-D tiles), final adaLN
// layer, unpatchify. Predicts the noise epsilon of x_t (and, with model.learn_sigma, the
// interpolation v between the log-variances beta_t and beta~_t).
#include <vector>

#include "attention/token_layout.h"
#include "models/adaln.h"
#include "models/model.h"
#include "models/transformer_block.h"

namespace mhla {

class DitBlockImpl : public torch::nn::Module {
 public:
  DitBlockImpl(std::shared_ptr<AttentionLayerImpl> attention, int64_t dim, int64_t mlp_hidden,
               bool bias = true, GeluForm gelu = GeluForm::exact);
  // The block's six per-sample [B, dim] vectors from SiLU(condition): shift, scale and gate of
  // the attention branch, then of the MLP branch.
  std::vector<torch::Tensor> modulation(const torch::Tensor& silu_condition);
  // The block on the residual stream x, whose attention input `normed` (norm1 of x, modulated)
  // the previous hinge made. Returns the stream after the MLP branch and the next branch's input:
  // next_norm of it, modulated by next_shift and next_scale.
  AdaLnHinge forward(const torch::Tensor& x, const torch::Tensor& normed,
                     const std::vector<torch::Tensor>& modulation, const torch::Tensor& next_shift,
                     const torch::Tensor& next_scale, LayerNormImpl& next_norm);
  LayerNormImpl& norm1() { return *norm1_; }

 private:
  LayerNorm norm1_{nullptr}, norm2_{nullptr};
  std::shared_ptr<AttentionLayerImpl> attention_;
  Mlp mlp_{nullptr};
  Linear modulation_{nullptr};  // SiLU(c) -> 6 x dim, zero-initialized
};
TORCH_MODULE(DitBlock);

// Sinusoidal embedding of timesteps t [B] -> [B, dim] (cos and sin halves, max period 10000).
torch::Tensor timestep_embedding(const torch::Tensor& t, int64_t dim);
// Fixed 2-D sin-cos position embedding of a grid, [grid_h * grid_w, dim] in raster order.
torch::Tensor sincos_position_embedding(int64_t grid_h, int64_t grid_w, int64_t dim);

class Dit : public Model {
 public:
  explicit Dit(const Config& config);
  // Not used: a DiT denoises (x_t, t, y); see denoise().
  torch::Tensor forward(const torch::Tensor& input) override;
  // x_t [B, C, S, S], t [B] int64, y [B] int64 (num_classes = the null class) -> eps [B, C, S, S],
  // followed by the variance output v [B, C, S, S] when the model learns its variance.
  torch::Tensor denoise(const torch::Tensor& x, const torch::Tensor& t, const torch::Tensor& y);
  bool learns_variance() const { return config_.model.learn_sigma; }
  int64_t output_channels() const { return config_.model.in_channels * (learns_variance() ? 2 : 1); }
  int64_t null_class() const { return config_.model.num_classes; }
  const TokenLayout& layout() const { return layout_; }

 private:
  Config config_;
  TokenLayout layout_;
  int64_t pad_before_ = 0, pad_after_ = 0;
  torch::nn::Conv2d patch_embed_{nullptr};
  torch::Tensor pos_embed_;  // buffer, block-major
  Linear time_fc1_{nullptr}, time_fc2_{nullptr};
  torch::nn::Embedding class_embedding_{nullptr};
  std::vector<DitBlock> blocks_;
  LayerNorm final_norm_{nullptr};
  Linear final_modulation_{nullptr}, final_linear_{nullptr};
};

void register_dit(Registry<ModelEntry>& registry);

}  // namespace mhla
