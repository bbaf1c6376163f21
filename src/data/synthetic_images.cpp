// Random images with random labels, for throughput measurements without data files.
#include "data/image_dataset.h"

namespace mhla {
namespace {

ImageDataset load(const Config& config, Split split) {
  const int64_t n = split == Split::kTrain ? 60000 : 10000;
  const int64_t side = config.model.image_size;
  torch::Generator generator = at::detail::createCPUGenerator(
      static_cast<uint64_t>(config.train.seed) * 2 + (split == Split::kTrain ? 0 : 1));
  ImageDataset dataset;
  dataset.name = "synthetic";
  dataset.num_classes = config.model.num_classes;
  dataset.images = torch::randint(0, 256, {n, config.model.in_channels, side, side}, generator,
                                  torch::kUInt8);
  dataset.labels = torch::randint(0, dataset.num_classes, {n}, generator, torch::kInt64);
  return dataset;
}

}  // namespace

void register_synthetic_images(Registry<DatasetEntry>& registry) {
  registry.add("synthetic", {"random images and labels (60,000 / 10,000) sized from model.*, for "
                             "speed measurements",
                             load});
}

}  // namespace mhla
