#include <iostream>

#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "core/device.h"
#include "core/logging.h"
#include "data/image_dataset.h"
#include "eval/classification_eval.h"
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
  auto model = model_registry().get(config.model.name).make(config);
  load_model_weights(*model, checkpoint.weights, checkpoint.dir + "/model.safetensors");
  model->to(device);
  ImageDataset test_set = load_dataset(config, Split::kTest);
  auto result = evaluate_classifier(*model, test_set, config, device);
  logger().info("{}: test accuracy {:.2f}% on {} images of {} (step {}), loss {:.4f}, {:.1f}s",
                checkpoint.dir, 100.0 * result.accuracy, result.count, test_set.name,
                checkpoint.state.step, result.loss, result.seconds);
  nlohmann::json out = {{"checkpoint", checkpoint.dir},  {"step", checkpoint.state.step},
                        {"dataset", test_set.name},      {"split", "test"},
                        {"count", result.count},         {"accuracy", result.accuracy},
                        {"loss", result.loss},           {"device", device.str()}};
  std::cout << out.dump() << std::endl;
  return 0;
}

}  // namespace

Command add_eval_command(CLI::App& parent) {
  auto args = std::make_shared<EvalArgs>();
  auto* app = parent.add_subcommand(
      "eval", "top-1 accuracy of a checkpoint on the full test split (prints one JSON line)");
  app->add_option("checkpoint", args->checkpoint,
                  "checkpoint folder, or a run folder (uses checkpoints/best, else last)")
      ->required();
  app->add_option("--set", args->overrides, "override a config key, e.g. data.eval_batch_size=500")
      ->type_name("KEY=VALUE");
  return {app, [args] { return run_eval(*args); }};
}

}  // namespace mhla
