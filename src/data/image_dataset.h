#pragma once
// An in-memory labelled image dataset (uint8 pixels) and the dataset registry.
#include <functional>
#include <string>

#include <torch/torch.h>

#include "core/config.h"
#include "core/registry.h"

namespace mhla {

enum class Split { kTrain, kTest };

struct ImageDataset {
  std::string name;
  torch::Tensor images;  // uint8 [N, C, H, W]
  torch::Tensor labels;  // int64 [N]
  int64_t num_classes = 0;
  double mean = 0.5, stddev = 0.5;  // pixel statistics (of [0, 1] values) for normalization

  int64_t size() const { return images.size(0); }
  int64_t channels() const { return images.size(1); }
  int64_t height() const { return images.size(2); }
  int64_t width() const { return images.size(3); }
};

struct DatasetEntry {
  std::string description;
  // Loads a split; `config` gives the root and limits. Errors name files and byte offsets.
  std::function<ImageDataset(const Config& config, Split split)> load;
};

Registry<DatasetEntry>& dataset_registry();

// Loads a split through the registry and applies data.train_limit / data.test_limit.
ImageDataset load_dataset(const Config& config, Split split);

void register_fashion_mnist(Registry<DatasetEntry>& registry);
void register_synthetic_images(Registry<DatasetEntry>& registry);

}  // namespace mhla
