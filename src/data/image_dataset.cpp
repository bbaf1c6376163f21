#include "data/image_dataset.h"

namespace mhla {

Registry<DatasetEntry>& dataset_registry() {
  static Registry<DatasetEntry> registry("dataset");
  return registry;
}

ImageDataset load_dataset(const Config& config, Split split) {
  ImageDataset dataset = dataset_registry().get(config.data.dataset).load(config, split);
  const int64_t limit = split == Split::kTrain ? config.data.train_limit : config.data.test_limit;
  if (limit > 0 && limit < dataset.size()) {
    dataset.images = dataset.images.slice(0, 0, limit);
    dataset.labels = dataset.labels.slice(0, 0, limit);
  }
  return dataset;
}

}  // namespace mhla
