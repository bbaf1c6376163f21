// mhla: train, evaluate and inspect models from YAML configs.
#include <iostream>

#include <c10/util/Exception.h>

#include "builtins.h"
#include "cli/commands.h"
#include "core/error.h"

int main(int argc, char** argv) {
  CLI::App app{"mhla: train and evaluate vision and language models with the attention registry "
               "(softmax, linear, MHLA)"};
  app.require_subcommand(1);
  std::vector<mhla::Command> commands;
  try {
    mhla::register_builtins();
    commands = {mhla::add_train_command(app), mhla::add_eval_command(app),
                mhla::add_info_command(app), mhla::add_bench_command(app),
                mhla::add_tokenizer_command(app), mhla::add_generate_command(app),
                mhla::add_sample_command(app), mhla::add_sweep_command(app)};
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 1;
  }
  for (const auto& command : commands) {
    if (!command.app->parsed()) continue;
    try {
      return command.run();
    } catch (const mhla::Error& e) {
      std::cerr << "error: " << e.what() << "\n";
      return 2;
    } catch (const c10::Error& e) {
      std::cerr << "error: " << e.what_without_backtrace() << "\n";
      return 3;
    } catch (const std::exception& e) {
      std::cerr << "error: " << e.what() << "\n";
      return 3;
    }
  }
  return 1;
}
