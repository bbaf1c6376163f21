// Image classification: an image dataset, the multi-threaded loader with augmentation,
// label-smoothed cross-entropy, top-1 accuracy on the full test split.
#include "core/device.h"
#include "core/error.h"
#include "data/batch_loader.h"
#include "data/image_dataset.h"
#include "eval/classification_eval.h"
#include "train/ema.h"
#include "train/task.h"

namespace mhla {
namespace {

class LoaderStream : public BatchStream {
 public:
  LoaderStream(const ImageDataset& data, const LoaderOptions& options, torch::Device device)
      : loader_(data, options), device_(device) {}
  std::optional<TrainBatch> next() override {
    auto batch = loader_.next();
    if (!batch) return std::nullopt;
    return TrainBatch{batch->images.to(device_, /*non_blocking=*/true),
                      batch->labels.to(device_, /*non_blocking=*/true), batch->index};
  }

 private:
  BatchLoader loader_;
  torch::Device device_;
};

class ClassificationTask : public Task {
 public:
  ClassificationTask(const Config& config, const torch::Device& device)
      : config_(config), device_(device) {
    train_ = load_dataset(config, Split::kTrain);
    test_ = load_dataset(config, Split::kTest);
    if (train_.channels() != config.model.in_channels) {
      fail("{}: model.in_channels = {} but {} images have {} channel(s)",
           config.where("model.in_channels"), config.model.in_channels, train_.name,
           train_.channels());
    }
    if (train_.height() > config.model.image_size || train_.width() > config.model.image_size) {
      fail("{}: model.image_size = {} is smaller than the {}x{} images of {}",
           config.where("model.image_size"), config.model.image_size, train_.height(),
           train_.width(), train_.name);
    }
    if (train_.num_classes > config.model.num_classes) {
      fail("{}: model.num_classes = {} but {} has {} classes", config.where("model.num_classes"),
           config.model.num_classes, train_.name, train_.num_classes);
    }
    steps_ = BatchLoader::batches_per_epoch(train_.size(), config.data.batch_size, true);
    if (steps_ == 0) {
      fail("{}: data.batch_size = {} exceeds the {} training images",
           config.where("data.batch_size"), config.data.batch_size, train_.size());
    }
    ce_ = torch::nn::functional::CrossEntropyFuncOptions().label_smoothing(
        config.train.label_smoothing);
  }

  std::string describe() const override {
    return fmt::format("{} / {} images", train_.size(), test_.size());
  }
  const char* unit() const override { return "img"; }
  int64_t samples_per_step() const override { return config_.data.batch_size; }
  int64_t steps_per_epoch() const override { return steps_; }

  std::unique_ptr<BatchStream> epoch(int64_t epoch, int64_t start_batch) override {
    const auto& c = config_;
    LoaderOptions options;
    options.batch_size = c.data.batch_size;
    options.workers = c.data.workers;
    options.prefetch = c.data.prefetch;
    options.out_size = c.model.image_size;
    options.crop_padding = c.data.crop_padding;
    options.hflip = c.data.hflip;
    options.shuffle = true;
    options.drop_last = true;
    options.seed = static_cast<uint64_t>(c.train.seed);
    options.epoch = epoch;
    options.start_batch = start_batch;
    options.pin_memory = device_.is_cuda();
    return std::make_unique<LoaderStream>(train_, options, device_);
  }

  torch::Tensor loss(const torch::Tensor& logits, const torch::Tensor& labels) const override {
    return torch::nn::functional::cross_entropy(logits.to(torch::kFloat32), labels, ce_);
  }

  // Top-1 accuracy on the test split. A run that keeps an EMA of the weights is evaluated with
  // it (the accuracy that picks the best checkpoint, and what `mhla eval` reports for its
  // checkpoints); the trained weights' accuracy and loss come beside it.
  EvalReport evaluate(Model& model) override {
    auto trained = evaluate_classifier(model, test_, config_, device_);
    if (!ema_weights_) {
      return {{{"accuracy", trained.accuracy},
               {"loss", trained.loss},
               {"count", trained.count},
               {"split", "test"}},
              trained.accuracy,
              fmt::format("test accuracy {:.2f}% ({} images), test loss {:.4f}, {:.1f}s",
                          100.0 * trained.accuracy, trained.count, trained.loss, trained.seconds)};
    }
    auto averaged = model_with_ema(model, config_, ema_weights_(), device_);
    auto r = evaluate_classifier(*averaged, test_, config_, device_);
    return {{{"accuracy", r.accuracy},
             {"loss", r.loss},
             {"count", r.count},
             {"split", "test"},
             {"weights", "ema"},
             {"accuracy_trained", trained.accuracy},
             {"loss_trained", trained.loss}},
            r.accuracy,
            fmt::format("test accuracy {:.2f}% with the EMA weights ({:.2f}% trained weights) "
                        "({} images), test loss {:.4f}, {:.1f}s",
                        100.0 * r.accuracy, 100.0 * trained.accuracy, r.count, r.loss,
                        r.seconds + trained.seconds)};
  }

  void attach_run(const std::string&, std::function<TensorMap()> ema_weights) override {
    ema_weights_ = std::move(ema_weights);
  }

 private:
  std::function<TensorMap()> ema_weights_;  // set when the run keeps an EMA
  Config config_;
  torch::Device device_;
  ImageDataset train_, test_;
  int64_t steps_ = 0;
  torch::nn::functional::CrossEntropyFuncOptions ce_;
};

}  // namespace

torch::Tensor Task::training_loss(Model& model, const TrainBatch& batch) {
  return loss(model.forward(batch.input), batch.target);
}

Registry<TaskEntry>& task_registry() {
  static Registry<TaskEntry> registry("task");
  return registry;
}

void register_classification_task(Registry<TaskEntry>& registry) {
  registry.add("classification",
               {"images -> labels: cross-entropy with label smoothing, top-1 test accuracy",
                [](const Config& c, const torch::Device& d) {
                  return std::make_unique<ClassificationTask>(c, d);
                }});
}

}  // namespace mhla
