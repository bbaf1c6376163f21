#include <iostream>

#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "core/device.h"
#include "core/logging.h"
#include "train/task.h"
#include "train/checkpoint.h"

namespace mhla {
namespace {

struct EvalArgs {
  std::string checkpoint;
  std::vector<std::string> overrides;
};

int run_eval(const EvalArgs& args) {
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
  load_model_weights(*model, checkpoint.weights, checkpoint.dir + "/model.safetensors");
  model->to(device);
  auto task = task_registry().get(entry.task).make(config, device);
  auto report = task->evaluate(*model);
  logger().info("{} (step {}): {}", checkpoint.dir, checkpoint.state.step, report.summary);
  nlohmann::json out = report.metrics;
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
      "eval", "evaluate a checkpoint on its task's full evaluation split: test accuracy for "
              "classifiers, val loss / perplexity / bits per byte for language models (one JSON line)");
  app->add_option("checkpoint", args->checkpoint,
                  "checkpoint folder, or a run folder (uses checkpoints/best, else last)")
      ->required();
  app->add_option("--set", args->overrides, "override a config key, e.g. data.eval_batch_size=500")
      ->type_name("KEY=VALUE");
  return {app, [args] { return run_eval(*args); }};
}

}  // namespace mhla
