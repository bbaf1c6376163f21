#if __has_include(<catch2/catch_session.hpp>)
#include <catch2/catch_session.hpp>
#else
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>
#endif

#include <torch/torch.h>

#include "builtins.h"

int main(int argc, char** argv) {
  mhla::register_builtins();
  torch::set_num_threads(2);
  return Catch::Session().run(argc, argv);
}
