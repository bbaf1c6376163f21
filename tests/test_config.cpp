#include <filesystem>

#include "catch_compat.h"
#include "core/config.h"
#include "core/error.h"
#include "test_helpers.h"

using namespace mhla;
using test::contains;
using test::error_of;

TEST_CASE("config: defaults and YAML values land in the typed structs", "[config]") {
  Config c = parse_config("model:\n  depth: 6\n  mlp_ratio: 2.5\nattention:\n  type: linear\n"
                          "data:\n  hflip: false\n",
                          "inline.yaml", {});
  CHECK(c.model.depth == 6);
  CHECK(c.model.mlp_ratio == 2.5);
  CHECK(c.attention.type == "linear");
  CHECK_FALSE(c.data.hflip);
  CHECK(c.model.width == 192);  // default kept
  CHECK(c.where("model.depth") == "inline.yaml:2");
}

TEST_CASE("config: --set overrides win over the file and are type-checked", "[config]") {
  Config c = parse_config("model:\n  depth: 6\n", "f.yaml", {"model.depth=3", "optim.lr=3e-4",
                                                             "run.name=\"my run\""});
  CHECK(c.model.depth == 3);
  CHECK(c.optim.lr == Approx(3e-4));
  CHECK(c.run.name == "my run");
  CHECK(contains(error_of([] { parse_config("", "f.yaml", {"model.depth=abc"}); }),
                 "--set model.depth=abc: model.depth expects an integer, got 'abc'"));
  CHECK(contains(error_of([] { parse_config("", "f.yaml", {"model.dept=3"}); }),
                 "unknown key 'model.dept' (did you mean 'model.depth'?)"));
  CHECK(contains(error_of([] { parse_config("", "f.yaml", {"model.depth"}); }), "key=value"));
}

TEST_CASE("config: unknown keys, wrong types and ranges name the key and file:line", "[config]") {
  CHECK(error_of([] { parse_config("model:\n  depht: 3\n", "c.yaml", {}); }) ==
        "c.yaml:2: unknown key 'model.depht' (did you mean 'model.depth'?)");
  CHECK(error_of([] { parse_config("model:\n  width: 192\n  depth: many\n", "c.yaml", {}); }) ==
        "c.yaml:3: model.depth expects an integer, got 'many'");
  CHECK(error_of([] { parse_config("optim:\n  lr: -1\n", "c.yaml", {}); }) ==
        "c.yaml:2: optim.lr = -1 is out of range [0, 10]");
  CHECK(contains(error_of([] { parse_config("data:\n  hflip: maybe\n", "c.yaml", {}); }),
                 "c.yaml:2: data.hflip expects true or false"));
  CHECK(contains(error_of([] { parse_config("model: 3\n", "c.yaml", {}); }),
                 "c.yaml:1: 'model' is a section"));
  CHECK(contains(error_of([] { parse_config("model:\n  depth: [1, 2]\n", "c.yaml", {}); }),
                 "c.yaml:2: model.depth expects a single value"));
  CHECK(contains(error_of([] { parse_config("train:\n  device: tpu\n", "c.yaml", {}); }),
                 "choose one of: auto, cpu, cuda"));
}

TEST_CASE("config: registry names are checked and listed", "[config][registry]") {
  auto message = error_of([] { parse_config("attention:\n  type: flash\n", "c.yaml", {}); });
  CHECK(message ==
        "c.yaml:2: attention.type = 'flash' is not a registered attention; registered: gated_deltanet, kda, linear, "
        "mhla, softmax");
  CHECK(contains(error_of([] { parse_config("", "c.yaml", {"optim.name=lion"}); }),
                 "registered: adamw, sgd"));
}

TEST_CASE("config: malformed YAML is reported with its line", "[config]") {
  auto message = error_of([] { parse_config("model:\n  depth: 3\n  width: [1, 2\n", "bad.yaml", {}); });
  CHECK(contains(message, "bad.yaml:"));
  CHECK(contains(message, "malformed YAML"));
}

TEST_CASE("config: cross-key checks name the key", "[config]") {
  CHECK(contains(error_of([] { parse_config("model:\n  width: 100\n  heads: 3\n", "c.yaml", {}); }),
                 "c.yaml:3: model.heads = 3 must divide model.width = 100"));
  CHECK(contains(error_of([] { parse_config("attention:\n  blocks: 12\n", "c.yaml", {}); }),
                 "c.yaml:2: attention.blocks = 12 must be a square number"));
  CHECK(contains(error_of([] { parse_config("model:\n  image_size: 30\ndata:\n  upscale: 4\n", "c.yaml", {}); }),
                 "c.yaml:4: data.upscale = 4 must divide model.image_size = 30"));
}

TEST_CASE("config: the resolved dump parses back to the same config", "[config]") {
  Config c = parse_config("model:\n  depth: 5\nrun:\n  name: x\n", "c.yaml",
                          {"optim.lr=0.00123456789", "attention.cpe=true"});
  Config back = parse_config(dump_config(c), "dump.yaml", {});
  CHECK(config_differences(c, back).empty());
  CHECK(back.optim.lr == c.optim.lr);
  Config other = parse_config("", "d.yaml", {"model.depth=7"});
  auto diff = config_differences(c, other);
  CHECK(std::find(diff.begin(), diff.end(), "model.depth") != diff.end());
}

TEST_CASE("config: every shipped config file is valid", "[config]") {
  namespace fs = std::filesystem;
  int count = 0;
  for (const auto& entry : fs::directory_iterator(test::source_dir() + "/configs")) {
    if (entry.path().extension() != ".yaml") continue;
    INFO(entry.path().string());
    CHECK_NOTHROW(load_config(entry.path().string(), {}));
    ++count;
  }
  CHECK(count >= 2);
}
