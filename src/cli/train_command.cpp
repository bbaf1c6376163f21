#include <filesystem>
#include <memory>

#include "cli/commands.h"
#include "core/config.h"
#include "core/error.h"
#include "core/logging.h"
#include "train/run_folder.h"
#include "train/stop_signal.h"
#include "train/trainer.h"

namespace mhla {

namespace fs = std::filesystem;

namespace {

struct TrainArgs {
  std::string config_path;
  std::vector<std::string> overrides;
  std::string resume_dir;
  int64_t profile_steps = 0;
  int64_t profile_warmup = 5;
};

int run_train(const TrainArgs& args) {
  Config config;
  std::string run_dir;
  bool resume = !args.resume_dir.empty();
  if (resume) {
    run_dir = args.resume_dir;
    const auto saved = fs::path(run_dir) / "config.yaml";
    if (!fs::exists(saved)) fail("{}: not a run folder (no config.yaml)", run_dir);
    if (!fs::exists(fs::path(run_dir) / "checkpoints" / "last" / "model.safetensors")) {
      fail("{}: no checkpoints/last to resume from", run_dir);
    }
    config = load_config(saved.string(), args.overrides);
    if (!args.config_path.empty()) {
      // Resuming must continue the same run: the given config has to agree with the saved one.
      Config given = load_config(args.config_path, args.overrides);
      std::string differing;
      for (const auto& key : config_differences(given, config)) {
        if (key.rfind("run.", 0) != 0) differing += (differing.empty() ? "" : ", ") + key;
      }
      if (!differing.empty()) {
        fail("{} differs from {} in: {}; resume with the run's own config (omit CONFIG)",
             args.config_path, saved.string(), differing);
      }
    }
  } else {
    if (args.config_path.empty()) fail("train: give a CONFIG file or --resume RUN_DIR");
    config = load_config(args.config_path, args.overrides);
    run_dir = create_run_folder(config);
  }
  open_run_log(run_dir);
  install_stop_handlers();
  // A new run that fails before its first training step (in set-up: a missing FID network or
  // data file, a setting the device refuses; or in that step: a kernel refused by
  // train.deterministic) has trained nothing. The folder this command just created holds only
  // its config and the error, and left behind it would block the same run.name once the cause
  // is fixed: remove it. Resumed runs and runs that trained keep their folder.
  auto remove_untrained = [&](const std::exception& e) {
    close_run_log();
    std::error_code ignored;
    fs::remove_all(run_dir, ignored);
    fail("{} (nothing was trained; the new run folder {} was removed)", e.what(), run_dir);
  };
  std::unique_ptr<Trainer> trainer;
  try {
    trainer = std::make_unique<Trainer>(config, run_dir, resume);
  } catch (const std::exception& e) {
    if (resume) throw;
    remove_untrained(e);
  }
  if (args.profile_steps > 0) trainer->profile_steps(args.profile_steps, args.profile_warmup);
  TrainOutcome outcome;
  try {
    outcome = trainer->run();
  } catch (const std::exception& e) {
    if (resume || trainer->steps_done() > 0) throw;
    trainer.reset();  // its loader threads and files, before the folder goes
    remove_untrained(e);
  }
  close_run_log();
  if (outcome.interrupted) return outcome.signal ? 128 + outcome.signal : 1;
  return 0;
}

}  // namespace

Command add_train_command(CLI::App& parent) {
  auto args = std::make_shared<TrainArgs>();
  auto* app = parent.add_subcommand("train", "train a model from a YAML config");
  app->add_option("config", args->config_path, "YAML config file (optional with --resume)")
      ->check(CLI::ExistingFile);
  app->add_option("--set", args->overrides, "override a config key: --set model.depth=6")
      ->type_name("KEY=VALUE")
      ->allow_extra_args(false);
  app->add_option("--resume", args->resume_dir,
                  "continue the run in this folder from checkpoints/last")
      ->check(CLI::ExistingDirectory);
  app->add_option("--profile", args->profile_steps,
                  "record N training steps with the profiler (after --profile-warmup steps): "
                  "RUN/profile/summary.md (GPU kernels, CPU operators) and trace.json")
      ->check(CLI::Range(1, 100000));
  app->add_option("--profile-warmup", args->profile_warmup,
                  "steps to run before the profiled ones (default 5; with train.cuda_graph, 4 or "
                  "more so that only graph replays are profiled)")
      ->check(CLI::Range(0, 1000000));
  app->footer(
      "Writes runs/<name>/{config.yaml, log.txt, metrics.jsonl, checkpoints/{last,best}}.\n"
      "SIGINT/SIGTERM write checkpoints/last and exit with 128+signal; resume with --resume.");
  return {app, [args] { return run_train(*args); }};
}

}  // namespace mhla
