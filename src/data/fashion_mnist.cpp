// Fashion-MNIST from its IDX files (Debian package dataset-fashion-mnist, or a copy under
// data/fashion-mnist).
#include <cstdlib>
#include <filesystem>
#include <vector>

#include "core/error.h"
#include "data/idx_file.h"
#include "data/image_dataset.h"

namespace mhla {
namespace {

namespace fs = std::filesystem;

const char* kDebianRoot = "/usr/share/datasets/fashion-mnist";

std::string resolve_root(const Config& config) {
  const std::string& root = config.data.root;
  if (root != "auto") {
    if (!fs::is_directory(root)) {
      fail("{}: data.root = '{}' is not a folder", config.where("data.root"), root);
    }
    return root;
  }
  std::vector<std::string> candidates;
  if (const char* env = std::getenv("MHLA_DATA_DIR")) {
    candidates.push_back((fs::path(env) / "fashion-mnist").string());
  }
  candidates.push_back("data/fashion-mnist");
  candidates.push_back(kDebianRoot);
  std::string searched;
  for (const auto& candidate : candidates) {
    if (fs::exists(fs::path(candidate) / "train-images-idx3-ubyte.gz")) return candidate;
    searched += (searched.empty() ? "" : ", ") + candidate;
  }
  fail("fashion_mnist: no data found in {} (install the Debian package dataset-fashion-mnist, "
       "run scripts/setup.sh, set MHLA_DATA_DIR or data.root)", searched);
}

ImageDataset load(const Config& config, Split split) {
  const fs::path root = resolve_root(config);
  const std::string prefix = split == Split::kTrain ? "train" : "t10k";
  auto find = [&](const std::string& stem) {
    for (const auto& name : {stem + ".gz", stem}) {
      if (fs::exists(root / name)) return (root / name).string();
    }
    return (root / (stem + ".gz")).string();  // read_idx_file reports it missing
  };
  const std::string image_path = find(prefix + "-images-idx3-ubyte");
  const std::string label_path = find(prefix + "-labels-idx1-ubyte");
  IdxArray images = read_idx_file(image_path, 3);
  IdxArray labels = read_idx_file(label_path, 1);
  if (images.dims[0] != labels.dims[0]) {
    fail("{} holds {} images but {} holds {} labels", image_path, images.dims[0], label_path,
         labels.dims[0]);
  }
  const int64_t n = images.dims[0];
  for (int64_t i = 0; i < n; ++i) {
    if (labels.data[i] >= 10) {
      fail("{}: byte offset {}: label {} is outside 0..9", label_path, 8 + i, labels.data[i]);
    }
  }
  ImageDataset dataset;
  dataset.name = "fashion_mnist";
  dataset.num_classes = 10;
  dataset.mean = 0.2860;
  dataset.stddev = 0.3530;
  dataset.images = torch::from_blob(images.data.data(), {n, 1, images.dims[1], images.dims[2]},
                                    torch::kUInt8)
                       .clone();
  dataset.labels =
      torch::from_blob(labels.data.data(), {n}, torch::kUInt8).to(torch::kInt64);
  return dataset;
}

}  // namespace

void register_fashion_mnist(Registry<DatasetEntry>& registry) {
  registry.add("fashion_mnist",
               {"Fashion-MNIST, 60,000 train / 10,000 test 28x28 grey images, 10 classes (IDX)",
                load});
}

}  // namespace mhla
