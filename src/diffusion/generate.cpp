#include "diffusion/generate.h"

#include <chrono>

#include "core/device.h"
#include "core/error.h"
#include "train/checkpoint.h"
#include "core/logging.h"
#include "core/progress.h"
#include "diffusion/samplers.h"
#include "models/dit.h"

namespace mhla {

SamplingModel load_sampling_model(const Checkpoint& checkpoint, const torch::Device& device,
                                  bool raw_weights, const std::string& what) {
  const Config& config = checkpoint.config;
  if (config.model.name != "dit") {
    fail("{}: {} needs a diffusion (dit) checkpoint, this one is '{}'", checkpoint.dir, what,
         config.model.name);
  }
  SamplingModel out;
  out.model = model_registry().get("dit").make(config);
  out.ema = !checkpoint.ema.empty() && !raw_weights;
  TensorMap weights = checkpoint.weights;
  if (out.ema) {
    for (const auto& [name, tensor] : checkpoint.ema) weights[name] = tensor;
  }
  load_model_weights(*out.model, weights,
                     checkpoint.dir + (out.ema ? "/ema.safetensors" : "/model.safetensors"));
  out.model->to(device);
  out.model->eval();
  out.dit = &dynamic_cast<Dit&>(*out.model);
  return out;
}

Generated generate_images(Dit& dit, const Config& config, const torch::Device& device,
                          const GenerateOptions& options) {
  torch::NoGradGuard no_grad;
  NoiseSchedule schedule(config.diffusion.schedule, config.diffusion.steps);
  SamplerOptions sampler;
  sampler.steps = options.steps;
  sampler.eta = options.eta;
  torch::Generator generator = at::detail::createCPUGenerator(options.seed);
  const bool bf16 = uses_bf16_autocast(config, device);
  std::vector<torch::Tensor> images, labels;
  const auto start = std::chrono::steady_clock::now();
  for (int64_t begin = 0; begin < options.count; begin += options.batch) {
    const int64_t b = std::min(options.batch, options.count - begin);
    auto y = options.label >= 0 ? torch::full({b}, options.label, torch::kLong)
                                : torch::remainder(torch::arange(begin, begin + b, torch::kLong),
                                                   config.model.num_classes);
    auto y_device = y.to(device);
    auto null = torch::full_like(y_device, dit.null_class());
    EpsilonFn eps = [&](const torch::Tensor& x, const torch::Tensor& t) {
      AutocastScope autocast(device, bf16);
      if (options.cfg == 1.0) return dit.denoise(x, t, y_device).to(torch::kFloat32);
      // Classifier-free guidance: eps_u + w (eps_c - eps_u), both halves in one batch.
      auto both = dit.denoise(torch::cat({x, x}), torch::cat({t, t}), torch::cat({y_device, null}))
                      .to(torch::kFloat32);
      auto conditional = both.narrow(0, 0, b), unconditional = both.narrow(0, b, b);
      const int64_t c = x.size(1);
      auto guided = unconditional.narrow(1, 0, c) +
                    options.cfg * (conditional.narrow(1, 0, c) - unconditional.narrow(1, 0, c));
      // A learned variance comes from the conditional half, as in DiT.
      if (conditional.size(1) > c) return torch::cat({guided, conditional.narrow(1, c, c)}, 1);
      return guided;
    };
    auto noise =
        at::normal(0.0, 1.0,
                   {b, config.model.in_channels, config.model.image_size, config.model.image_size},
                   generator, torch::TensorOptions().dtype(torch::kFloat32))
            .to(device);
    auto x = options.sampler == "ddpm" ? ddpm_sample(schedule, eps, noise, sampler, generator)
                                       : ddim_sample(schedule, eps, noise, sampler, generator);
    images.push_back(x.cpu());
    labels.push_back(y);
    if (options.log_progress) {
      const double elapsed =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      logger().info("sampled {}/{} | {}", begin + b, options.count,
                    rate_and_eta(begin + b, options.count, elapsed, "img"));
    }
  }
  return {torch::cat(images), torch::cat(labels)};
}

}  // namespace mhla
