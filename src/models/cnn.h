#pragma once
// A small VGG-style convolutional classifier: three stages of two 3x3 conv + BatchNorm + ReLU
// (width, 2 width, 4 width channels), 2x2 max-pooling between stages, global average pooling,
// dropout and a linear head. Its pooled features are the FID-FMNIST feature space.
#include "models/linear.h"
#include "models/model.h"

namespace mhla {

class Cnn : public Model {
 public:
  explicit Cnn(const Config& config);
  torch::Tensor forward(const torch::Tensor& images) override;
  torch::Tensor features(const torch::Tensor& images) override;

 private:
  torch::nn::Sequential body_{nullptr};
  torch::nn::Dropout dropout_{nullptr};
  Linear head_{nullptr};
};

void register_cnn(Registry<ModelEntry>& registry);

}  // namespace mhla
