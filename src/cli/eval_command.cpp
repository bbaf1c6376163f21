#include <chrono>
#include <iostream>

#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "core/device.h"
#include "core/error.h"
#include "core/logging.h"
#include "diffusion/generate.h"
#include "eval/fid.h"
#include "models/dit.h"
#include "train/checkpoint.h"
#include "train/task.h"

namespace mhla {
namespace {

struct EvalArgs {
  std::string checkpoint;
  std::vector<std::string> overrides;
  bool fid = false;
  int64_t count = 10000;
  int64_t steps = 50;
  double cfg = 1.0;
  int64_t seed = 0;
  int64_t batch = 500;
  std::string fid_network;
  bool raw_weights = false;
};

// mhla eval --fid: draws `count` samples (DDIM, EMA weights) and scores them against the
// training set with the FID feature network.
int run_fid(const EvalArgs& args) {
  Checkpoint checkpoint = read_checkpoint(args.checkpoint, args.overrides);
  const Config& config = checkpoint.config;
  if (args.cfg < 0) fail("--cfg {} must be >= 0", args.cfg);
  const torch::Device device = resolve_device(config);
  auto sampling = load_sampling_model(checkpoint, device, args.raw_weights, "--fid");
  const bool use_ema = sampling.ema;
  const std::string network =
      args.fid_network.empty() ? config.diffusion.fid_network : args.fid_network;
  FidScorer scorer(network, device);
  GenerateOptions options;
  options.count = args.count;
  options.steps = args.steps;
  options.cfg = args.cfg;
  options.seed = static_cast<uint64_t>(args.seed);
  options.batch = args.batch;
  options.log_progress = true;
  const auto start = std::chrono::steady_clock::now();
  auto generated = generate_images(*sampling.dit, config, device, options);
  const double sample_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  auto result = scorer.score(generated.images, config);
  nlohmann::json out = result.describe();
  out["checkpoint"] = checkpoint.dir;
  out["step"] = checkpoint.state.step;
  out["sampler"] = "ddim";
  out["steps"] = args.steps;
  out["cfg"] = args.cfg;
  out["eta"] = 0.0;
  out["seed"] = args.seed;
  out["ema"] = use_ema;
  out["sample_seconds"] = sample_seconds;
  logger().info(
      "{} {:.3f}, KID {:.5f} +- {:.5f} ({} samples, {} DDIM steps, cfg {}; network sha256 {})",
      kFidLabel, result.fid, result.kid.mean, result.kid.stddev, result.samples, args.steps,
      args.cfg, result.network_sha256.substr(0, 16));
  std::cout << out.dump() << std::endl;
  return 0;
}

int run_eval(const EvalArgs& args) {
  if (args.fid) return run_fid(args);
  // The full test split unless the user limits it explicitly (the run may have trained with
  // data.test_limit for speed).
  std::vector<std::string> overrides = {"data.test_limit=0"};
  overrides.insert(overrides.end(), args.overrides.begin(), args.overrides.end());
  Checkpoint checkpoint = read_checkpoint(args.checkpoint, overrides);
  const Config& config = checkpoint.config;
  const torch::Device device = resolve_device(config);
  if (config.train.threads > 0) torch::set_num_threads(static_cast<int>(config.train.threads));
  const auto& entry = model_registry().get(config.model.name);
  auto model = entry.make(config);
  // Classifiers trained with an EMA are evaluated with it, as during training (--raw-weights: the
  // trained weights); other tasks evaluate the trained weights here.
  const bool use_ema =
      entry.task == "classification" && !checkpoint.ema.empty() && !args.raw_weights;
  TensorMap weights = checkpoint.weights;
  if (use_ema) {
    for (const auto& [name, tensor] : checkpoint.ema) weights[name] = tensor;
  }
  load_model_weights(*model, weights,
                     checkpoint.dir + (use_ema ? "/ema.safetensors" : "/model.safetensors"));
  model->to(device);
  auto task = task_registry().get(entry.task).make(config, device);
  auto report = task->evaluate(*model);
  logger().info("{} (step {}, {} weights): {}", checkpoint.dir, checkpoint.state.step,
                use_ema ? "EMA" : "trained", report.summary);
  nlohmann::json out = report.metrics;
  out["weights"] = use_ema ? "ema" : "trained";
  out["checkpoint"] = checkpoint.dir;
  out["step"] = checkpoint.state.step;
  out["device"] = device.str();
  std::cout << out.dump() << std::endl;
  return 0;
}

}  // namespace

Command add_eval_command(CLI::App& parent) {
  auto args = std::make_shared<EvalArgs>();
  auto* app = parent.add_subcommand(
      "eval",
      "evaluate a checkpoint on its task's full evaluation split: test accuracy for "
      "classifiers, val loss / perplexity / bits per byte for language models (one JSON line)");
  app->add_option("checkpoint", args->checkpoint,
                  "checkpoint folder, or a run folder (uses checkpoints/best, else last)")
      ->required();
  app->add_option("--set", args->overrides, "override a config key, e.g. data.eval_batch_size=500")
      ->type_name("KEY=VALUE");
  app->add_flag("--fid", args->fid,
                "diffusion models: sample and report FID-FMNIST (own feature network) and KID "
                "against the training set");
  app->add_option("--n", args->count, "--fid: number of samples")
      ->check(CLI::Range(int64_t{2}, int64_t{1} << 24))
      ->capture_default_str();
  app->add_option("--steps", args->steps, "--fid: DDIM steps")
      ->check(CLI::Range(int64_t{1}, int64_t{100000}))
      ->capture_default_str();
  app->add_option("--cfg", args->cfg, "--fid: classifier-free guidance scale (1 = none)")
      ->capture_default_str();
  app->add_option("--seed", args->seed, "--fid: noise seed")->capture_default_str();
  app->add_option("--batch", args->batch, "--fid: samples per batch")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 16))
      ->capture_default_str();
  app->add_option(
      "--fid-network", args->fid_network,
      "--fid: feature network run folder (default: the config's diffusion.fid_network)");
  app->add_flag("--raw-weights", args->raw_weights,
                "use the trained weights, not the EMA (--fid sampling; classifiers' accuracy)");
  return {app, [args] { return run_eval(*args); }};
}

}  // namespace mhla
