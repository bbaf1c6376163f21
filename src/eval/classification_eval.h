#pragma once
// Top-1 accuracy and mean cross-entropy of a classifier over a whole split.
#include "core/config.h"
#include "data/image_dataset.h"
#include "models/model.h"

namespace mhla {

struct ClassificationResult {
  double accuracy = 0.0;  // fraction in [0, 1]
  double loss = 0.0;      // mean cross-entropy, no label smoothing
  int64_t count = 0;
  double seconds = 0.0;
};

ClassificationResult evaluate_classifier(Model& model, const ImageDataset& dataset,
                                         const Config& config, const torch::Device& device);

}  // namespace mhla
