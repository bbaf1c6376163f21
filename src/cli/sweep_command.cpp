#include <filesystem>
#include <iostream>

#include "cli/commands.h"
#include "core/atomic_file.h"
#include "core/config.h"
#include "core/error.h"
#include "core/logging.h"
#include "train/run_folder.h"
#include "train/stop_signal.h"
#include "train/sweep.h"
#include "train/trainer.h"

namespace mhla {
namespace {

namespace fs = std::filesystem;

struct SweepArgs {
  std::string config_path;
  std::vector<std::string> vary;
  std::vector<std::string> overrides;
  std::string name;
  bool dry_run = false;
};

std::string describe(const SweepRun& run) {
  std::string out;
  for (const auto& [key, value] : run.settings) out += (out.empty() ? "" : " ") + key + "=" + value;
  return out;
}

int run_sweep(const SweepArgs& args) {
  std::vector<SweepAxis> axes;
  for (const auto& text : args.vary) {
    axes.push_back(parse_sweep_axis(text));
    if (axes.back().key == "run.name" || axes.back().key == "run.root") {
      fail("--vary {}: a sweep names its runs itself (use --name, or --set run.root)", text);
    }
  }
  if (axes.empty()) fail("sweep: give at least one --vary KEY=V1,V2,...");
  for (const auto& o : args.overrides) {
    if (o.rfind("run.name=", 0) == 0)
      fail("--set {}: a sweep names its runs itself (use --name)", o);
  }
  const std::string prefix =
      args.name.empty() ? fs::path(args.config_path).stem().string() : args.name;
  const auto runs = expand_sweep(axes, prefix);
  // Every combination's config is checked before anything trains.
  std::vector<Config> configs;
  for (const auto& run : runs) {
    auto overrides = args.overrides;
    for (const auto& [key, value] : run.settings) overrides.push_back(key + "=" + value);
    overrides.push_back("run.name=" + run.name);
    try {
      configs.push_back(load_config(args.config_path, overrides));
    } catch (const std::exception& e) {
      fail("sweep run {} ({}): {}", run.name, describe(run), e.what());
    }
  }
  const std::string root = configs.front().run.root;
  if (args.dry_run) {
    for (const auto& run : runs)
      std::cout << (fs::path(root) / run.name).string() << "  " << describe(run) << "\n";
    return 0;
  }
  // Runs that exist must be this sweep's (same settings), so resuming them is continuing them.
  for (size_t i = 0; i < runs.size(); ++i) {
    const fs::path dir = fs::path(root) / runs[i].name;
    if (!fs::exists(dir)) continue;
    if (!fs::exists(dir / "checkpoints" / "last" / "model.safetensors")) {
      fail(
          "{}: exists without checkpoints/last (stopped before its first checkpoint); remove it "
          "to train that run again",
          dir.string());
    }
    Config saved = load_config((dir / "config.yaml").string(), {});
    std::string differing;
    for (const auto& key : config_differences(configs[i], saved)) {
      if (key.rfind("run.", 0) != 0) differing += (differing.empty() ? "" : ", ") + key;
    }
    if (!differing.empty()) {
      fail("{}: trained with other settings ({}); remove it or give the sweep another --name",
           dir.string(), differing);
    }
  }
  install_stop_handlers();
  const std::string summary = (fs::path(root) / (prefix + ".sweep")).string();
  auto write_summary = [&] {
    std::vector<nlohmann::json> rows;
    std::string jsonl;
    for (const auto& run : runs) {
      const auto dir = (fs::path(root) / run.name).string();
      if (!fs::exists(dir)) continue;
      rows.push_back(sweep_row(run, dir));
      jsonl += rows.back().dump() + "\n";
    }
    std::string command = "mhla sweep " + args.config_path;
    for (const auto& v : args.vary) command += " --vary " + v;
    for (const auto& o : args.overrides) command += " --set " + o;
    if (!args.name.empty()) command += " --name " + args.name;
    write_file_atomic(summary + ".md",
                      fmt::format("# Sweep {}\n\n`{}`\n\nLast evaluation of each run:\n\n{}",
                                  prefix, command, sweep_markdown(axes, rows)));
    write_file_atomic(summary + ".jsonl", jsonl);
  };
  for (size_t i = 0; i < runs.size(); ++i) {
    const auto& config = configs[i];
    std::string dir = (fs::path(root) / runs[i].name).string();
    const bool resume = fs::exists(dir);
    if (!resume) dir = create_run_folder(config);
    logger().info("sweep {}: run {}/{} {} ({})", prefix, i + 1, runs.size(), dir,
                  describe(runs[i]));
    open_run_log(dir);
    Trainer trainer(config, dir, resume);
    TrainOutcome outcome = trainer.run();
    close_run_log();
    write_summary();
    if (outcome.interrupted) {
      logger().info("sweep {} stopped in {}; the same command continues it", prefix, dir);
      return outcome.signal ? 128 + outcome.signal : 1;
    }
  }
  logger().info("sweep {}: {} runs done; summary in {}.md", prefix, runs.size(), summary);
  return 0;
}

}  // namespace

Command add_sweep_command(CLI::App& parent) {
  auto args = std::make_shared<SweepArgs>();
  auto* app = parent.add_subcommand(
      "sweep", "train every combination of config values, one run folder each (an ablation)");
  app->add_option("config", args->config_path, "YAML config file")
      ->required()
      ->check(CLI::ExistingFile);
  app->add_option("--vary", args->vary,
                  "KEY=V1,V2,... to sweep (repeatable; the product is trained; ';' separates "
                  "values that contain commas)")
      ->type_name("KEY=VALUES")
      ->required();
  app->add_option("--set", args->overrides, "override a config key in every run")
      ->type_name("KEY=VALUE");
  app->add_option("--name", args->name,
                  "run-name prefix and summary name (default: the config's name)");
  app->add_flag("--dry-run", args->dry_run, "print the runs and stop");
  app->footer(
      "Runs <run.root>/<name>-<key>=<value>-..., one after another; finished runs are kept and an\n"
      "interrupted one resumes when the same command runs again. Summary: "
      "<run.root>/<name>.sweep.md\n"
      "and .sweep.jsonl (each run's settings and last evaluation), rewritten after every run.");
  return {app, [args] { return run_sweep(*args); }};
}

}  // namespace mhla
