#include "eval/fid.h"

#include <filesystem>

#include "core/error.h"
#include "core/logging.h"
#include "core/sha256.h"
#include "data/batch_loader.h"
#include "data/image_dataset.h"
#include "train/checkpoint.h"
#include "train/safetensors.h"

namespace mhla {
namespace {

constexpr int64_t kKidReferenceImages = 10000;

}  // namespace

nlohmann::json FidResult::describe() const {
  return {{"metric", kFidLabel},        {"fid_fmnist", fid},
          {"kid_fmnist", kid.mean},     {"kid_fmnist_std", kid.stddev},
          {"samples", samples},         {"reference", reference},
          {"feature_network", network}, {"feature_network_sha256", network_sha256}};
}

FidScorer::FidScorer(const std::string& network, const torch::Device& device) : device_(device) {
  if (!std::filesystem::exists(network)) {
    fail(
        "{}: FID feature network not found; train it with `mhla train configs/fid_net_fmnist.yaml` "
        "(or point diffusion.fid_network / --fid-network at its run folder)",
        network);
  }
  Checkpoint checkpoint = read_checkpoint(network);
  dir_ = checkpoint.dir;
  config_ = checkpoint.config;
  const auto& entry = model_registry().get(config_.model.name);
  model_ = entry.make(config_);
  const std::string weights = dir_ + "/model.safetensors";
  load_model_weights(*model_, checkpoint.weights, weights);
  sha256_ = sha256_file(weights);
  model_->to(device_);
  model_->eval();
  // The probe call fails early (with the model's message) if this model has no feature head.
  const auto channels = config_.model.in_channels, size = config_.model.image_size;
  {
    torch::NoGradGuard no_grad;
    model_->features(
        torch::zeros({1, channels, size, size}, torch::TensorOptions().device(device_)));
  }
  auto dataset = load_dataset(config_, Split::kTest);
  mean_ = dataset.mean;
  stddev_ = dataset.stddev;
}

torch::Tensor FidScorer::features(const torch::Tensor& images) {
  torch::NoGradGuard no_grad;
  const int64_t size = config_.model.image_size;
  std::vector<torch::Tensor> out;
  for (int64_t begin = 0; begin < images.size(0); begin += 500) {
    auto x = images.narrow(0, begin, std::min<int64_t>(500, images.size(0) - begin))
                 .to(device_, torch::kFloat32);
    if (x.size(-1) != size || x.size(-2) != size) x = torch::adaptive_avg_pool2d(x, {size, size});
    x = ((x + 1.0) * 0.5 - mean_) / stddev_;
    out.push_back(model_->features(x).to(torch::kFloat32).cpu());
  }
  return torch::cat(out);
}

const FidScorer::Reference& FidScorer::reference(const Config& generator) {
  const int64_t upscale = generator.data.upscale, size = generator.model.image_size;
  const std::string key = fmt::format("train_s{}_u{}", size, upscale);
  if (auto it = references_.find(key); it != references_.end()) return it->second;
  const std::string cache = fmt::format("{}/fid_reference_{}.safetensors", dir_, key);
  Reference ref;
  if (std::filesystem::exists(cache)) {
    Metadata metadata;
    TensorMap tensors;
    try {
      tensors = load_safetensors(cache, &metadata);
    } catch (const std::exception& e) {
      // A damaged cache costs a recomputation, never a result.
      logger().info("{}; recomputing the reference statistics", e.what());
      metadata.clear();
    }
    if (metadata["feature_network_sha256"] == sha256_ && tensors.count("mean") &&
        tensors.count("covariance") && tensors.count("kid_features")) {
      ref.fit.mean = tensors.at("mean");
      ref.fit.covariance = tensors.at("covariance");
      ref.count = ref.fit.count = std::stoll(metadata["count"]);
      ref.kid_features = tensors.at("kid_features");
      logger().info("FID reference statistics from {}", cache);
      return references_.emplace(key, std::move(ref)).first->second;
    }
    logger().info("{}: computed with other feature-network weights; recomputing", cache);
  }
  Config data_config = generator;
  data_config.data.train_limit = 0;
  auto dataset = load_dataset(data_config, Split::kTrain);
  LoaderOptions options;
  options.batch_size = 1000;
  options.workers = std::max<int64_t>(1, generator.data.workers);
  options.out_size = size / upscale;
  options.unit_range = true;
  BatchLoader loader(dataset, options);
  std::vector<torch::Tensor> all;
  while (auto batch = loader.next())
    all.push_back(features(upscale_images(batch->images, upscale)));
  auto features_all = torch::cat(all);
  ref.fit = fit_gaussian(features_all);
  ref.count = features_all.size(0);
  ref.kid_features =
      features_all.narrow(0, 0, std::min(kKidReferenceImages, ref.count)).contiguous();
  save_safetensors(cache,
                   {{"mean", ref.fit.mean},
                    {"covariance", ref.fit.covariance},
                    {"kid_features", ref.kid_features}},
                   {{"feature_network_sha256", sha256_},
                    {"count", std::to_string(ref.count)},
                    {"dataset", dataset.name},
                    {"image_size", std::to_string(size)},
                    {"upscale", std::to_string(upscale)}});
  logger().info("FID reference statistics of {} training images cached in {}", ref.count, cache);
  return references_.emplace(key, std::move(ref)).first->second;
}

FidResult FidScorer::score(const torch::Tensor& images, const Config& generator) {
  if (images.size(0) < 2) fail("FID needs at least 2 images, got {}", images.size(0));
  const Reference& ref = reference(generator);
  auto generated = features(images);
  FidResult result;
  result.fid = frechet_distance(fit_gaussian(generated), ref.fit);
  const int64_t subset = std::min<int64_t>({1000, generated.size(0), ref.kid_features.size(0)});
  result.kid = kernel_distance(generated, ref.kid_features, 100, subset, 0);
  result.samples = images.size(0);
  result.network = dir_;
  result.network_sha256 = sha256_;
  result.reference = fmt::format(
      "{} training images ({}x{}{})", ref.count, generator.model.image_size,
      generator.model.image_size,
      generator.data.upscale > 1 ? fmt::format(", upsampled x{}", generator.data.upscale) : "");
  return result;
}

}  // namespace mhla
