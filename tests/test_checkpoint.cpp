#include <cstdlib>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "catch_compat.h"
#include "core/atomic_file.h"
#include "core/config.h"
#include "core/error.h"
#include "test_helpers.h"
#include "train/checkpoint.h"
#include "train/safetensors.h"

using namespace mhla;
using test::contains;
using test::error_of;
namespace fs = std::filesystem;

namespace {

uint64_t read_u64_le(const std::string& bytes) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= uint64_t{static_cast<uint8_t>(bytes[i])} << (8 * i);
  return v;
}

TensorMap sample_tensors() {
  torch::manual_seed(0);
  return {{"a.weight", torch::randn({3, 4})},
          {"b", torch::arange(5, torch::kInt64)},
          {"c.half", torch::randn({2, 2}).to(torch::kBFloat16)},
          {"d.bytes", torch::tensor({1, 2, 3}, torch::kUInt8)},
          {"e.scalar", torch::tensor(2.5, torch::kFloat64)},
          {"f.empty", torch::zeros({0, 3})}};
}

}  // namespace

TEST_CASE("checkpoint: safetensors files follow the format byte for byte", "[checkpoint]") {
  auto tensors = sample_tensors();
  const std::string bytes = encode_safetensors(tensors, {{"format", "mhla"}});
  const uint64_t header_size = read_u64_le(bytes);
  REQUIRE(8 + header_size <= bytes.size());
  CHECK((8 + header_size) % 8 == 0);
  auto header = nlohmann::json::parse(bytes.substr(8, header_size));
  CHECK(header["__metadata__"]["format"] == "mhla");
  uint64_t total = 0;
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  for (const auto& [name, tensor] : tensors) {
    INFO(name);
    REQUIRE(header.contains(name));
    auto entry = header[name];
    CHECK(entry["shape"].get<std::vector<int64_t>>() == tensor.sizes().vec());
    auto offsets = entry["data_offsets"].get<std::vector<uint64_t>>();
    CHECK(offsets[1] - offsets[0] == static_cast<uint64_t>(tensor.numel() * tensor.element_size()));
    ranges.push_back({offsets[0], offsets[1]});
    total += offsets[1] - offsets[0];
  }
  CHECK(header["a.weight"]["dtype"] == "F32");
  CHECK(header["b"]["dtype"] == "I64");
  CHECK(header["c.half"]["dtype"] == "BF16");
  CHECK(header["d.bytes"]["dtype"] == "U8");
  CHECK(header["e.scalar"]["dtype"] == "F64");
  std::sort(ranges.begin(), ranges.end());
  uint64_t cursor = 0;
  for (auto [begin, end] : ranges) {
    CHECK(begin == cursor);  // contiguous
    cursor = end;
  }
  CHECK(bytes.size() == 8 + header_size + total);  // exact length
  // The raw bytes of a tensor sit at its offsets.
  auto a = tensors["a.weight"];
  auto begin = header["a.weight"]["data_offsets"][0].get<uint64_t>();
  CHECK(std::memcmp(bytes.data() + 8 + header_size + begin, a.data_ptr(), 48) == 0);
}

TEST_CASE("checkpoint: safetensors round-trips every dtype exactly", "[checkpoint]") {
  test::TempDir dir("st");
  auto tensors = sample_tensors();
  const auto path = (dir.path() / "x.safetensors").string();
  save_safetensors(path, tensors, {{"k", "v"}});
  Metadata metadata;
  auto back = load_safetensors(path, &metadata);
  CHECK(metadata.at("k") == "v");
  REQUIRE(back.size() == tensors.size());
  for (const auto& [name, t] : tensors) {
    INFO(name);
    CHECK(back.at(name).scalar_type() == t.scalar_type());
    CHECK(torch::equal(back.at(name), t));
  }
}

TEST_CASE("checkpoint: Python's safetensors reads our files", "[checkpoint]") {
  const std::string python = test::source_dir() + "/.venv/bin/python";
  if (!fs::exists(python)) {
    WARN("no project .venv: skipped");
    return;
  }
  test::TempDir dir("py");
  const auto path = (dir.path() / "x.safetensors").string();
  save_safetensors(path, sample_tensors());
  const std::string script =
      "import sys; from safetensors.torch import load_file; t = load_file(sys.argv[1]); "
      "print(sorted(t)); assert t['b'].tolist() == [0, 1, 2, 3, 4]; "
      "assert t['a.weight'].shape == (3, 4); assert t['e.scalar'].item() == 2.5; print('ok')";
  const std::string command = test::shell_quote(python) + " -c " + test::shell_quote(script) + " " +
                              test::shell_quote(path) + " > " + test::shell_quote(path + ".out") + " 2>&1";
  int status = std::system(command.c_str());
  std::ifstream in(path + ".out");
  std::string output((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  INFO(output);
  CHECK(status == 0);
  CHECK(contains(output, "ok"));
}

TEST_CASE("checkpoint: truncated or corrupt safetensors are errors with byte offsets", "[checkpoint]") {
  const std::string bytes = encode_safetensors(sample_tensors());
  const uint64_t header_size = read_u64_le(bytes);
  CHECK(contains(error_of([&] { decode_safetensors(bytes.substr(0, 5), "w.st"); }),
                 "w.st: byte offset 0: file too short"));
  CHECK(contains(error_of([&] { decode_safetensors(bytes.substr(0, 50), "w.st"); }),
                 "w.st: byte offset 0: header length"));
  auto cut = error_of([&] { decode_safetensors(bytes.substr(0, bytes.size() - 7), "w.st"); });
  CHECK(contains(cut, "w.st: byte offset"));
  CHECK(contains(cut, "truncated"));
  std::string broken = bytes;
  broken[8] = '#';
  CHECK(contains(error_of([&] { decode_safetensors(broken, "w.st"); }), "malformed JSON header"));
  CHECK(contains(error_of([&] { decode_safetensors(bytes + "junk", "w.st"); }), "trailing bytes"));
  (void)header_size;
}

TEST_CASE("checkpoint: model, optimizer and trainer state round-trip; bad folders are named", "[checkpoint]") {
  test::TempDir dir("ckpt");
  Config c = parse_config("", "t", {"model.width=32", "model.depth=1", "model.heads=2"});
  auto model = model_registry().get("deit").make(c);
  auto optimizer = optimizer_registry().get("adamw").make(make_param_groups(*model, 0.05), c.optim);
  TrainerState state;
  state.step = 17;
  state.epoch = 2;
  state.batch_in_epoch = 3;
  state.best_score = 0.5;
  state.cpu_rng = capture_rng_state(false);
  const auto ckpt = (dir.path() / "checkpoints" / "last").string();
  fs::create_directories(dir.path() / "checkpoints");
  save_checkpoint(ckpt, c, *model, optimizer.get(), state);
  save_checkpoint(ckpt, c, *model, optimizer.get(), state);  // replaces atomically
  for (const auto& entry : fs::directory_iterator(dir.path() / "checkpoints")) {
    CHECK(entry.path().filename() == "last");  // no staging folders left behind
  }
  auto loaded = read_checkpoint(dir.str());
  CHECK(loaded.dir == ckpt);
  CHECK(loaded.state.step == 17);
  CHECK(loaded.state.batch_in_epoch == 3);
  CHECK(config_differences(loaded.config, c).empty());
  auto other = model_registry().get("deit").make(c);
  load_model_weights(*other, loaded.weights, "w");
  for (const auto& [name, t] : model_tensors(*model)) CHECK(torch::equal(t, model_tensors(*other).at(name)));

  Config wider = parse_config("", "t", {"model.width=64", "model.depth=1", "model.heads=2"});
  auto mismatched = model_registry().get("deit").make(wider);
  CHECK(contains(error_of([&] { load_model_weights(*mismatched, loaded.weights, "w.st"); }),
                 "has shape"));
  // A truncated weights file.
  const auto weights = ckpt + "/model.safetensors";
  fs::resize_file(weights, fs::file_size(weights) - 100);
  auto message = error_of([&] { read_checkpoint(ckpt); });
  CHECK(contains(message, weights + ": byte offset"));
  CHECK(contains(message, "truncated"));
  CHECK(contains(error_of([&] { read_checkpoint((dir.path() / "nope").string()); }),
                 "no such checkpoint or run folder"));
}

TEST_CASE("checkpoint: atomic writes leave the old file when replaced", "[checkpoint]") {
  test::TempDir dir("atomic");
  const auto path = (dir.path() / "f.txt").string();
  write_file_atomic(path, "one");
  write_file_atomic(path, "two");
  CHECK(read_file(path) == "two");
  int files = 0;
  for (const auto& entry : fs::directory_iterator(dir.path())) files += entry.is_regular_file();
  CHECK(files == 1);
}
