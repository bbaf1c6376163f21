#pragma once
// GPT-style language model: token embedding (tied to the output head), rotary or learned
// positions, pre-norm blocks whose attention comes from the registry in causal mode (one type,
// or a per-layer pattern such as mhla,mhla,mhla,softmax), GELU or SwiGLU MLP, final norm.
#include <vector>

#include "models/model.h"
#include "models/transformer_block.h"

namespace mhla {

// The attention type of each layer: attention.pattern cycled over model.depth, or
// attention.type everywhere.
std::vector<std::string> layer_attention_types(const Config& config);

class Gpt : public Model {
 public:
  explicit Gpt(const Config& config);
  // tokens [B, T] (int64) -> logits [B, T, vocab]
  torch::Tensor forward(const torch::Tensor& tokens) override;
  const std::vector<TransformerBlock>& blocks() const { return blocks_; }

  // Decoding: one state per layer; step() feeds one token [B, 1] at states[0].position and
  // returns its logits [B, 1, vocab].
  std::vector<DecodeState> new_decode_states() const;
  torch::Tensor step(const torch::Tensor& token, std::vector<DecodeState>& states);

 private:
  Config config_;
  torch::nn::Embedding token_embedding_{nullptr}, position_embedding_{nullptr};
  std::vector<TransformerBlock> blocks_;
  LayerNorm norm_{nullptr};
};

void register_gpt(Registry<ModelEntry>& registry);

}  // namespace mhla
