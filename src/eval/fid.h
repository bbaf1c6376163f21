#pragma once
// FID-FMNIST (own feature network): the Fréchet distance and KID between features of generated
// images and of the Fashion-MNIST training set, taken from the pooled features of a classifier
// the framework trains itself (configs/fid_net_fmnist.yaml). Not comparable with Inception FID;
// every result carries that label and the SHA-256 of the feature network's weights.
#include <memory>
#include <string>

#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include "core/config.h"
#include "eval/frechet.h"
#include "models/model.h"

namespace mhla {

inline constexpr const char* kFidLabel = "FID-FMNIST (own feature network)";

struct FidResult {
  double fid = 0.0;
  KidResult kid;
  int64_t samples = 0;
  nlohmann::json describe() const;  // fid_fmnist, kid_fmnist, kid_fmnist_std, label, network
  std::string network, network_sha256, reference;
};

class FidScorer {
 public:
  // network: the feature classifier's checkpoint or run folder (checkpoints/best, else last).
  FidScorer(const std::string& network, const torch::Device& device);

  // Pooled features (float32 [n, F], CPU) of images in [-1, 1], [n, C, S, S]; other sizes than
  // the network's are average-pooled to it.
  torch::Tensor features(const torch::Tensor& images);

  // Scores generated images against the training split prepared as `generator` trains on it
  // (image size, upscaling). The reference statistics are computed once and cached beside the
  // network's weights, keyed by their hash.
  FidResult score(const torch::Tensor& images, const Config& generator);

  const std::string& sha256() const { return sha256_; }

 private:
  struct Reference {
    GaussianFit fit;
    torch::Tensor kid_features;  // the first 10,000 training images' features
    int64_t count = 0;
  };
  const Reference& reference(const Config& generator);

  std::string dir_, sha256_;
  Config config_;
  torch::Device device_;
  std::shared_ptr<Model> model_;
  double mean_ = 0.5, stddev_ = 0.5;  // the network's input normalization (of [0, 1] pixels)
  std::map<std::string, Reference> references_;
};

}  // namespace mhla
