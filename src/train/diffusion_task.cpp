// Class-conditional diffusion (DDPM, epsilon prediction) on an image dataset scaled to [-1, 1]:
// random timestep and noise per image, MSE between predicted and true noise, labels dropped to
// the null class for classifier-free guidance. Evaluation: the same loss on the full test split
// with fixed timesteps and noise (comparable across runs and resumes).
#include <filesystem>

#include "core/device.h"
#include "core/error.h"
#include "data/batch_loader.h"
#include "data/image_dataset.h"
#include "diffusion/generate.h"
#include "diffusion/noise_schedule.h"
#include "diffusion/variational_bound.h"
#include "eval/fid.h"
#include "image/png_writer.h"
#include "models/dit.h"
#include "train/checkpoint.h"
#include "train/ema.h"
#include "train/task.h"

namespace mhla {
namespace {

class ImageStream : public BatchStream {
 public:
  ImageStream(const ImageDataset& data, const LoaderOptions& options, torch::Device device,
              int64_t upscale)
      : loader_(data, options), device_(device), upscale_(upscale) {}
  std::optional<TrainBatch> next() override {
    auto batch = loader_.next();
    if (!batch) return std::nullopt;
    return TrainBatch{upscale_images(batch->images.to(device_, true), upscale_),
                      batch->labels.to(device_, true), batch->index};
  }

 private:
  BatchLoader loader_;
  torch::Device device_;
  int64_t upscale_;
};

Dit& as_dit(Model& model) {
  auto* dit = dynamic_cast<Dit*>(&model);
  if (!dit) fail("the diffusion task needs a dit model");
  return *dit;
}

class DiffusionTask : public Task {
 public:
  DiffusionTask(const Config& config, const torch::Device& device)
      : config_(config),
        device_(device),
        schedule_(NoiseSchedule(config.diffusion.schedule, config.diffusion.steps).to(device)) {
    train_ = load_dataset(config, Split::kTrain);
    test_ = load_dataset(config, Split::kTest);
    if (train_.channels() != config.model.in_channels) {
      fail("{}: model.in_channels = {} but {} images have {} channel(s)",
           config.where("model.in_channels"), config.model.in_channels, train_.name,
           train_.channels());
    }
    if (train_.height() > config.model.image_size) {
      fail("{}: model.image_size = {} is smaller than the {}x{} images of {}",
           config.where("model.image_size"), config.model.image_size, train_.height(),
           train_.width(), train_.name);
    }
    // A missing feature network would only surface at the first evaluation, after training.
    if (config.diffusion.fid_samples > 0 && !std::filesystem::exists(config.diffusion.fid_network)) {
      fail("{}: diffusion.fid_network = '{}' does not exist; train it with `mhla train "
           "configs/fid_net_fmnist.yaml` or set diffusion.fid_samples=0",
           config.where("diffusion.fid_network"), config.diffusion.fid_network);
    }
    steps_ = BatchLoader::batches_per_epoch(train_.size(), config.data.batch_size, true);
    if (steps_ == 0) {
      fail("{}: data.batch_size = {} exceeds the {} training images",
           config.where("data.batch_size"), config.data.batch_size, train_.size());
    }
  }

  std::string describe() const override {
    return fmt::format("{} / {} images, {} diffusion steps ({})", train_.size(), test_.size(),
                       schedule_.steps(), config_.diffusion.schedule);
  }
  const char* unit() const override { return "img"; }
  int64_t samples_per_step() const override { return config_.data.batch_size; }
  int64_t steps_per_epoch() const override { return steps_; }

  LoaderOptions loader_options(bool train) const {
    LoaderOptions o;
    o.batch_size = train ? config_.data.batch_size : config_.data.eval_batch_size;
    o.workers = config_.data.workers;
    o.prefetch = config_.data.prefetch;
    o.out_size = config_.model.image_size / config_.data.upscale;
    o.crop_padding = train ? config_.data.crop_padding : 0;
    o.hflip = train && config_.data.hflip;
    o.shuffle = train;
    o.drop_last = train;
    o.seed = static_cast<uint64_t>(config_.train.seed);
    o.pin_memory = device_.is_cuda();
    o.unit_range = true;
    return o;
  }

  std::unique_ptr<BatchStream> epoch(int64_t epoch, int64_t start_batch) override {
    auto o = loader_options(true);
    o.epoch = epoch;
    o.start_batch = start_batch;
    return std::make_unique<ImageStream>(train_, o, device_, config_.data.upscale);
  }

  torch::Tensor loss(const torch::Tensor& predicted, const torch::Tensor& noise) const override {
    return torch::mse_loss(predicted.to(torch::kFloat32), noise.to(torch::kFloat32));
  }

  torch::Tensor training_loss(Model& model, const TrainBatch& batch) override {
    Dit& dit = as_dit(model);
    const auto& x0 = batch.input;
    const auto b = x0.size(0);
    auto long_options = torch::TensorOptions().dtype(torch::kLong).device(x0.device());
    auto t = torch::randint(0, schedule_.steps(), {b}, long_options);
    auto noise = torch::randn_like(x0);
    auto xt = schedule_.add_noise(x0, noise, t);
    auto drop = torch::rand({b}, x0.options()).lt(config_.diffusion.label_dropout);
    auto y = torch::where(drop, torch::full_like(batch.target, dit.null_class()), batch.target);
    auto out = dit.denoise(xt, t, y);
    if (!dit.learns_variance()) return loss(out, noise);
    // Learned variance: the MSE trains epsilon, the bound term (on a detached epsilon) trains v.
    const int64_t c = x0.size(1);
    auto eps = out.narrow(1, 0, c), v = out.narrow(1, c, c);
    return loss(eps, noise) + variational_bound_term(schedule_, x0, xt, t, eps, v).mean();
  }

  EvalReport evaluate(Model& model) override {
    Dit& dit = as_dit(model);
    const auto start = std::chrono::steady_clock::now();
    const bool was_training = model.is_training();
    model.eval();
    torch::NoGradGuard no_grad;
    BatchLoader loader(test_, loader_options(false));
    // Fixed timesteps and noise from a generator of our own (the training RNG is untouched).
    torch::Generator generator = at::detail::createCPUGenerator(1234);
    double total = 0.0;
    int64_t count = 0;
    const bool bf16 = uses_bf16_autocast(config_, device_);
    while (auto batch = loader.next()) {
      auto x0 = upscale_images(batch->images.to(device_), config_.data.upscale);
      const auto b = x0.size(0);
      auto t = torch::randint(0, schedule_.steps(), {b}, generator, torch::kLong).to(device_);
      auto noise =
          at::normal(0.0, 1.0, x0.sizes(), generator, torch::TensorOptions().dtype(torch::kFloat32))
              .to(device_);
      torch::Tensor eps;
      {
        AutocastScope autocast(device_, bf16);
        eps = dit.denoise(schedule_.add_noise(x0, noise, t), t, batch->labels.to(device_))
                  .narrow(1, 0, x0.size(1));
      }
      total +=
          torch::mse_loss(eps.to(torch::kFloat32), noise, torch::Reduction::Sum).item<double>() /
          static_cast<double>(noise[0].numel());
      count += b;
    }
    const double value = total / static_cast<double>(count);
    EvalReport report{
        {{"diffusion_loss", value}, {"count", count}, {"split", "test"}},
        -value,
        fmt::format("test diffusion loss {:.5f} ({} images, fixed t and noise)", value, count)};
    if (config_.diffusion.grid_samples > 0 || config_.diffusion.fid_samples > 0)
      sample_hooks(model, report);
    if (was_training) model.train();
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    report.summary += fmt::format(", {:.1f}s", seconds);
    ++evaluations_;
    return report;
  }

  void attach_run(const std::string& run_dir,
                  std::function<TensorMap()> sampling_weights) override {
    run_dir_ = run_dir;
    sampling_weights_ = std::move(sampling_weights);
  }

 private:
  // Samples with the EMA weights when the run keeps them: a sample grid into samples/ and
  // FID-FMNIST / KID against the training set on diffusion.fid_samples images.
  void sample_hooks(Model& model, EvalReport& report) {
    std::shared_ptr<Model> ema_model;
    Model* sampler = &model;
    if (sampling_weights_) {
      ema_model = model_with_ema(model, config_, sampling_weights_(), device_);
      sampler = ema_model.get();
    }
    GenerateOptions options;
    options.steps = config_.diffusion.sample_steps;
    options.cfg = config_.diffusion.cfg_scale;
    options.eta = config_.diffusion.eta;
    if (config_.diffusion.grid_samples > 0 && !run_dir_.empty()) {
      options.count = config_.diffusion.grid_samples;
      auto grid = generate_images(as_dit(*sampler), config_, device_, options);
      std::filesystem::create_directories(run_dir_ + "/samples");
      // Numbered after the grids already there, so a resumed run never overwrites one.
      int64_t index = evaluations_ + 1;
      auto path_of = [&](int64_t n) { return fmt::format("{}/samples/eval_{:03d}.png", run_dir_, n); };
      while (std::filesystem::exists(path_of(index))) ++index;
      evaluations_ = index - 1;
      const std::string path = path_of(index);
      write_png(path, image_grid(grid.images, config_.model.num_classes));
      report.metrics["sample_grid"] = path;
    }
    if (config_.diffusion.fid_samples > 0) {
      if (!fid_) fid_ = std::make_unique<FidScorer>(config_.diffusion.fid_network, device_);
      options.count = config_.diffusion.fid_samples;
      options.seed = 1;
      auto generated = generate_images(as_dit(*sampler), config_, device_, options);
      auto result = fid_->score(generated.images, config_);
      auto described = result.describe();
      described["steps"] = options.steps;
      described["cfg"] = options.cfg;
      report.metrics["fid"] = described;
      report.summary +=
          fmt::format(", {} {:.2f}, KID {:.4f} ({} samples, {} DDIM steps, cfg {})", kFidLabel,
                      result.fid, result.kid.mean, result.samples, options.steps, options.cfg);
    }
  }

 private:
  Config config_;
  torch::Device device_;
  NoiseSchedule schedule_;
  ImageDataset train_, test_;
  int64_t steps_ = 0;
  int64_t evaluations_ = 0;
  std::string run_dir_;
  std::function<TensorMap()> sampling_weights_;
  std::unique_ptr<FidScorer> fid_;
};

}  // namespace

void register_diffusion_task(Registry<TaskEntry>& registry) {
  registry.add("diffusion",
               {"class-conditional DDPM: epsilon-prediction MSE, label dropout for guidance",
                [](const Config& c, const torch::Device& d) {
                  return std::make_unique<DiffusionTask>(c, d);
                }});
}

}  // namespace mhla
