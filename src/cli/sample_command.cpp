#include <cmath>
#include <filesystem>
#include <iostream>

#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "core/device.h"
#include "core/error.h"
#include "core/logging.h"
#include "diffusion/generate.h"
#include "image/png_writer.h"
#include "models/dit.h"
#include "train/checkpoint.h"

namespace mhla {
namespace {

struct SampleArgs {
  std::string checkpoint;
  int64_t label = -1;
  int64_t count = 16;
  int64_t steps = 50;
  double cfg = 1.0;
  double eta = 0.0;
  std::string sampler = "ddim";
  std::string out;
  int64_t seed = 0;
  int64_t batch = 256;
  bool raw_weights = false;
  std::vector<std::string> overrides;
};

int run_sample(const SampleArgs& args) {
  Checkpoint checkpoint = read_checkpoint(args.checkpoint, args.overrides);
  const Config& config = checkpoint.config;
  if (args.label >= config.model.num_classes) {
    fail("--class {}: the model has classes 0..{}", args.label, config.model.num_classes - 1);
  }
  if (args.cfg < 0) fail("--cfg {} must be >= 0", args.cfg);
  const torch::Device device = resolve_device(config);
  // EMA weights when the run kept them (DiT samples with the EMA), unless --raw-weights.
  auto sampling = load_sampling_model(checkpoint, device, args.raw_weights, "sample");
  const bool use_ema = sampling.ema;
  auto& dit = *sampling.dit;
  torch::NoGradGuard no_grad;
  std::filesystem::create_directories(args.out);
  GenerateOptions options;
  options.count = args.count;
  options.label = args.label;
  options.steps = args.steps;
  options.cfg = args.cfg;
  options.eta = args.eta;
  options.sampler = args.sampler;
  options.seed = static_cast<uint64_t>(args.seed);
  options.batch = args.batch;
  options.log_progress = true;
  auto generated = generate_images(dit, config, device, options);
  for (int64_t i = 0; i < args.count; ++i) {
    write_png(fmt::format("{}/sample_{:05d}_class{}.png", args.out, i, generated.labels[i].item<int64_t>()),
              generated.images[i]);
  }
  auto& stacked = generated.images;
  const auto columns = static_cast<int64_t>(std::ceil(std::sqrt(static_cast<double>(stacked.size(0)))));
  write_png(args.out + "/grid.png", image_grid(stacked.narrow(0, 0, std::min<int64_t>(stacked.size(0), 256)), columns));
  nlohmann::json summary = {{"out", args.out}, {"count", args.count}, {"sampler", args.sampler},
                            {"steps", args.sampler == "ddpm" ? config.diffusion.steps : args.steps},
                            {"cfg", args.cfg}, {"eta", args.eta}, {"ema", use_ema},
                            {"checkpoint", checkpoint.dir}};
  std::cout << summary.dump() << std::endl;
  return 0;
}

}  // namespace

Command add_sample_command(CLI::App& parent) {
  auto args = std::make_shared<SampleArgs>();
  auto* app = parent.add_subcommand("sample", "draw images from a diffusion (dit) checkpoint");
  app->add_option("checkpoint", args->checkpoint, "checkpoint folder or run folder")->required();
  app->add_option("--class", args->label, "class to draw (-1: cycle through the classes)")->capture_default_str();
  app->add_option("--n", args->count, "number of images")->check(CLI::Range(int64_t{1}, int64_t{1} << 24))->capture_default_str();
  app->add_option("--steps", args->steps, "DDIM steps")->check(CLI::Range(int64_t{1}, int64_t{100000}))->capture_default_str();
  app->add_option("--cfg", args->cfg, "classifier-free guidance scale (1 = none)")->capture_default_str();
  app->add_option("--eta", args->eta, "DDIM stochasticity")->check(CLI::Range(0.0, 1.0))->capture_default_str();
  app->add_option("--sampler", args->sampler, "ddim or ddpm (all steps, ancestral)")
      ->check(CLI::IsMember({"ddim", "ddpm"}))->capture_default_str();
  app->add_option("--out", args->out, "folder for the PNGs and grid.png")->required();
  app->add_option("--seed", args->seed, "noise seed")->capture_default_str();
  app->add_option("--batch", args->batch, "images per batch")->check(CLI::Range(int64_t{1}, int64_t{1} << 16))->capture_default_str();
  app->add_flag("--raw-weights", args->raw_weights, "use the trained weights, not the EMA");
  app->add_option("--set", args->overrides, "override a config key")->type_name("KEY=VALUE");
  return {app, [args] { return run_sample(*args); }};
}

}  // namespace mhla
