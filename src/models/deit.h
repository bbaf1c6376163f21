#pragma once
// DeiT-style image classifier: patch embedding (input padded so the patch grid splits into the
// attention's 2-D tiles), learned position embedding, pre-norm blocks with registry attention,
// average pooling, linear head. Tokens stay block-major from the patch embedding on.
#include <vector>

#include "attention/token_layout.h"
#include "models/model.h"
#include "models/transformer_block.h"

namespace mhla {

// The token layout a config gives: patch grid rounded up so sqrt(blocks) tiles divide it.
TokenLayout image_token_layout(const Config& config);

class Deit : public Model {
 public:
  explicit Deit(const Config& config);
  torch::Tensor forward(const torch::Tensor& images) override;
  const TokenLayout& layout() const { return layout_; }

 private:
  Config config_;
  TokenLayout layout_;
  int64_t pad_before_ = 0, pad_after_ = 0;
  torch::nn::Conv2d patch_embed_{nullptr};
  torch::Tensor pos_embed_;
  std::vector<TransformerBlock> blocks_;
  LayerNorm norm_{nullptr};
  Linear head_{nullptr};
};

void register_deit(Registry<ModelEntry>& registry);

}  // namespace mhla
