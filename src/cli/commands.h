#pragma once
// One file per subcommand; each adds itself to the CLI and returns what main runs.
#include <functional>

#include <CLI/CLI.hpp>

namespace mhla {

struct Command {
  CLI::App* app = nullptr;
  std::function<int()> run;  // returns the process exit code
};

Command add_train_command(CLI::App& parent);
Command add_eval_command(CLI::App& parent);
Command add_info_command(CLI::App& parent);
Command add_bench_command(CLI::App& parent);
Command add_tokenizer_command(CLI::App& parent);
Command add_generate_command(CLI::App& parent);
Command add_sample_command(CLI::App& parent);
Command add_sweep_command(CLI::App& parent);

}  // namespace mhla
