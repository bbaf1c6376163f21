#include "models/cnn.h"

namespace mhla {

Cnn::Cnn(const Config& config) {
  const auto& m = config.model;
  torch::nn::Sequential body;
  int64_t in = m.in_channels;
  for (int64_t stage = 0; stage < 3; ++stage) {
    const int64_t out = m.width << stage;
    for (int rep = 0; rep < 2; ++rep) {
      body->push_back(torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out, 3).padding(1).bias(false)));
      body->push_back(torch::nn::BatchNorm2d(out));
      body->push_back(torch::nn::ReLU());
      in = out;
    }
    if (stage < 2) body->push_back(torch::nn::MaxPool2d(2));
  }
  body_ = register_module("body", body);
  dropout_ = register_module("dropout", torch::nn::Dropout(0.3));
  head_ = register_module("head", Linear(in, m.num_classes));
}

torch::Tensor Cnn::features(const torch::Tensor& images) {
  return body_->forward(images).mean({2, 3});
}

torch::Tensor Cnn::forward(const torch::Tensor& images) {
  return head_->forward(dropout_->forward(features(images)));
}

void register_cnn(Registry<ModelEntry>& registry) {
  registry.add("cnn", {"VGG-style CNN classifier (3 stages of 2 conv-BN-ReLU, global pool); the "
                       "FID-FMNIST feature network",
                       "classification", [](const Config& c) { return std::make_shared<Cnn>(c); }});
}

}  // namespace mhla
