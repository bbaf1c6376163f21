#include <iostream>

#include <fmt/format.h>
#include <torch/torch.h>

#include "attention/attention_type.h"
#include "cli/commands.h"
#include "core/config.h"
#include "core/environment.h"
#include "data/image_dataset.h"
#include "models/model.h"
#include "train/optimizer.h"
#include "train/schedule.h"

namespace mhla {
namespace {

struct InfoArgs {
  bool config_keys = false;
};

template <typename Entry>
void print_registry(const std::string& title, const Registry<Entry>& registry) {
  std::cout << title << ":\n";
  for (const auto& [name, entry] : registry.entries()) {
    std::cout << fmt::format("  {:<16} {}\n", name, entry.description);
  }
}

int run_info(const InfoArgs& args) {
  if (args.config_keys) {
    std::cout << "| key | type | default | meaning |\n|---|---|---|---|\n";
    for (const auto& doc : config_key_docs()) {
      std::cout << fmt::format("| `{}` | {} | `{}` | {} |\n", doc.path, doc.type, doc.default_value,
                               doc.doc);
    }
    return 0;
  }
  print_registry("models", model_registry());
  std::cout << "attention types (backends):\n";
  for (const auto& [name, type] : attention_registry().entries()) {
    std::string backends;
    for (const auto& [backend, fn] : type.backends)
      backends += (backends.empty() ? "" : ", ") + backend;
    std::cout << fmt::format("  {:<16} [{}] {}\n", name, backends, type.description);
  }
  print_registry("datasets", dataset_registry());
  print_registry("optimizers", optimizer_registry());
  print_registry("schedules", schedule_registry());
  std::cout << fmt::format("build: LibTorch {}, CUDA {}, {} CPU threads\n", TORCH_VERSION,
                           torch::cuda::is_available() ? fmt::format("available ({} device(s))",
                                                                     torch::cuda::device_count())
                                                       : std::string("not available"),
                           torch::get_num_threads());
  // What a run started from this shell would swap out (README, "Kernel switches").
  const auto switches = environment_switches_set();
  std::cout << fmt::format("kernel switches ({} known) set in the environment: {}\n",
                           kernel_switch_names().size(), switches.empty() ? "none" : switches);
  return 0;
}

}  // namespace

Command add_info_command(CLI::App& parent) {
  auto args = std::make_shared<InfoArgs>();
  auto* app = parent.add_subcommand(
      "info",
      "list registered models, attention types and backends, datasets, optimizers and "
      "schedules");
  app->add_flag("--config-keys", args->config_keys,
                "print every config key with type, default and meaning (markdown)");
  return {app, [args] { return run_info(*args); }};
}

}  // namespace mhla
