#include "eval/classification_eval.h"

#include <chrono>

#include "core/device.h"
#include "data/batch_loader.h"

namespace mhla {

ClassificationResult evaluate_classifier(Model& model, const ImageDataset& dataset,
                                         const Config& config, const torch::Device& device) {
  const auto start = std::chrono::steady_clock::now();
  const bool was_training = model.is_training();
  model.eval();
  torch::NoGradGuard no_grad;
  LoaderOptions options;
  options.batch_size = config.data.eval_batch_size;
  options.workers = config.data.workers;
  options.prefetch = config.data.prefetch;
  options.out_size = config.model.image_size;
  options.pin_memory = device.is_cuda();
  BatchLoader loader(dataset, options);
  auto correct = torch::zeros({}, torch::TensorOptions().dtype(torch::kInt64).device(device));
  auto loss_sum = torch::zeros({}, torch::TensorOptions().dtype(torch::kFloat64).device(device));
  const bool bf16 = uses_bf16_autocast(config, device);
  while (auto batch = loader.next()) {
    auto images = batch->images.to(device, /*non_blocking=*/true);
    auto labels = batch->labels.to(device, /*non_blocking=*/true);
    torch::Tensor logits;
    {
      AutocastScope autocast(device, bf16);
      logits = model.forward(images);
    }
    logits = logits.to(torch::kFloat32);
    loss_sum += torch::nn::functional::cross_entropy(
                    logits, labels,
                    torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum))
                    .to(torch::kFloat64);
    correct += logits.argmax(1).eq(labels).sum();
  }
  if (was_training) model.train();
  ClassificationResult result;
  result.count = dataset.size();
  result.accuracy = static_cast<double>(correct.item<int64_t>()) / static_cast<double>(result.count);
  result.loss = loss_sum.item<double>() / static_cast<double>(result.count);
  result.seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return result;
}

}  // namespace mhla
