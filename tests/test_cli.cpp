// The mhla binary end to end: help, info, bad input of every kind (clear one-line error, nonzero
// exit), SIGTERM during training (checkpoint, clean exit) and resume.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "catch_compat.h"
#include "core/atomic_file.h"
#include "core/sha256.h"
#include "test_helpers.h"

using namespace mhla;
using test::contains;
using test::error_of;
namespace fs = std::filesystem;

namespace {

// The single "error: ..." line of a failed command.
std::string error_line(const std::string& output) {
  auto at = output.find("error: ");
  if (at == std::string::npos) return "";
  return output.substr(at, output.find('\n', at) - at);
}

const std::string kTiny =
    "model:\n  width: 32\n  depth: 1\n  heads: 2\n  patch_size: 4\nattention:\n  type: mhla\n"
    "  blocks: 4\ndata:\n  train_limit: 256\n  test_limit: 100\n  batch_size: 32\n"
    "train:\n  epochs: 1\n  log_every: 2\n";

// Starts `mhla ARGS...` in `dir` with its output in dir/`log`, waits until `ready` has content,
// sends SIGTERM and returns the wait status.
int terminate_when_ready(const fs::path& dir, const std::vector<std::string>& args, const fs::path& ready,
                         const std::string& log) {
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    if (::chdir(dir.c_str()) != 0) ::_exit(99);
    if (!::freopen(log.c_str(), "w", stdout) || !::freopen(log.c_str(), "a", stderr)) ::_exit(97);
    std::vector<char*> argv = {const_cast<char*>(MHLA_BINARY)};
    for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    ::execv(MHLA_BINARY, argv.data());
    ::_exit(98);
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (!(fs::exists(ready) && fs::file_size(ready) > 0) && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ::kill(child, SIGTERM);
  int status = 0;
  ::waitpid(child, &status, 0);
  REQUIRE(fs::exists(ready));
  return status;
}

}  // namespace

TEST_CASE("cli: --help works on every command", "[cli]") {
  for (const char* args : {"--help", "train --help", "eval --help", "info --help", "bench --help",
                           "tokenizer --help", "generate --help", "sample --help", "sweep --help"}) {
    INFO(args);
    auto r = test::run_mhla(args);
    CHECK(r.exit_code == 0);
    CHECK(contains(r.output, "Usage"));
  }
  auto none = test::run_mhla("");
  CHECK(none.exit_code != 0);
  auto unknown = test::run_mhla("fly");
  CHECK(unknown.exit_code != 0);
}

TEST_CASE("cli: info lists every registry with backends", "[cli][registry]") {
  auto r = test::run_mhla("info");
  REQUIRE(r.exit_code == 0);
  for (const char* part : {"deit", "softmax", "linear", "mhla", "[reference", "fashion_mnist",
                           "adamw", "cosine"}) {
    INFO(part);
    CHECK(contains(r.output, part));
  }
  auto keys = test::run_mhla("info --config-keys");
  CHECK(contains(keys.output, "| `attention.blocks` |"));
}

TEST_CASE("cli: bad input gets one clear line and a nonzero exit", "[cli]") {
  test::TempDir dir("cli-bad");
  const auto cwd = dir.str();
  test::write_text(dir.path() / "malformed.yaml", "model:\n  depth: 3\n   width: 4\n");
  auto malformed = test::run_mhla("train malformed.yaml", cwd);
  CHECK(malformed.exit_code != 0);
  CHECK(contains(error_line(malformed.output), "malformed.yaml:3"));
  CHECK(contains(error_line(malformed.output), "malformed YAML"));

  test::write_text(dir.path() / "unknown.yaml", "attention:\n  type: performer\n");
  auto unknown = test::run_mhla("train unknown.yaml", cwd);
  CHECK(unknown.exit_code != 0);
  CHECK(error_line(unknown.output) ==
        "error: unknown.yaml:2: attention.type = 'performer' is not a registered attention; "
        "registered: gated_deltanet, kda, linear, mhla, softmax");

  test::write_text(dir.path() / "valid.yaml", "model:\n  depth: 2\n");
  auto bad_set = test::run_mhla("train valid.yaml --set model.depth=0", cwd);
  CHECK(contains(error_line(bad_set.output), "model.depth = 0 is out of range"));

  // A missing and a corrupt data file.
  test::write_text(dir.path() / "empty" / ".keep", "");
  test::write_text(dir.path() / "nodata.yaml",
                   "data:\n  root: empty\n  train_limit: 10\n");
  auto missing = test::run_mhla("train nodata.yaml", cwd);
  CHECK(missing.exit_code != 0);
  CHECK(contains(error_line(missing.output), "empty/train-images-idx3-ubyte.gz: file not found"));
  fs::create_directories(dir.path() / "corrupt");
  for (const char* name : {"train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz",
                           "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"}) {
    fs::copy_file(fs::path(test::fashion_mnist_root()) / name, dir.path() / "corrupt" / name);
  }
  // Keep only the first half of the gzip stream of the training images.
  auto images = dir.path() / "corrupt" / "train-images-idx3-ubyte.gz";
  fs::resize_file(images, fs::file_size(images) / 2);
  test::write_text(dir.path() / "corrupt.yaml", "data:\n  root: corrupt\n");
  auto corrupt = test::run_mhla("train corrupt.yaml", cwd);
  CHECK(corrupt.exit_code != 0);
  CHECK(contains(error_line(corrupt.output), "corrupt/train-images-idx3-ubyte.gz: byte offset"));

  auto no_config = test::run_mhla("train does-not-exist.yaml", cwd);
  CHECK(no_config.exit_code != 0);
  auto no_checkpoint = test::run_mhla("eval nowhere", cwd);
  CHECK(no_checkpoint.exit_code != 0);
  CHECK(contains(error_line(no_checkpoint.output), "nowhere: no such checkpoint or run folder"));
}

TEST_CASE("cli: train, eval, a truncated checkpoint, and an existing run name", "[cli]") {
  test::TempDir dir("cli-run");
  const auto cwd = dir.str();
  test::write_text(dir.path() / "tiny.yaml", kTiny);
  auto train = test::run_mhla("train tiny.yaml --set run.name=first", cwd);
  INFO(train.output);
  REQUIRE(train.exit_code == 0);
  CHECK(contains(train.output, "img/s"));
  CHECK(contains(train.output, "ETA"));
  const auto run = dir.path() / "runs" / "first";
  for (const char* file : {"config.yaml", "log.txt", "metrics.jsonl", "checkpoints/last/model.safetensors",
                           "checkpoints/best/model.safetensors"}) {
    INFO(file);
    CHECK(fs::exists(run / file));
  }
  // metrics.jsonl: one JSON object per line, with an evaluation record.
  std::ifstream metrics(run / "metrics.jsonl");
  std::string line;
  int evals = 0, steps = 0;
  while (std::getline(metrics, line)) {
    auto record = nlohmann::json::parse(line);
    if (record.contains("eval")) ++evals;
    if (record.contains("loss")) ++steps;
  }
  CHECK(evals == 1);
  CHECK(steps >= 3);

  auto eval = test::run_mhla("eval runs/first", cwd);
  REQUIRE(eval.exit_code == 0);
  auto json = nlohmann::json::parse(eval.output.substr(eval.output.rfind("{\"")));
  CHECK(json["count"] == 10000);  // the full test split, whatever the run used
  auto limited = test::run_mhla("eval runs/first --set data.test_limit=50", cwd);
  REQUIRE(limited.exit_code == 0);
  CHECK(nlohmann::json::parse(limited.output.substr(limited.output.rfind("{\""))) ["count"] == 50);
  CHECK(json["accuracy"].get<double>() >= 0.0);

  auto again = test::run_mhla("train tiny.yaml --set run.name=first", cwd);
  CHECK(again.exit_code != 0);
  CHECK(contains(error_line(again.output), "exists already"));
  CHECK(contains(error_line(again.output), "--resume runs/first"));
  // A start whose set-up fails removes the folder it created, so the same name works once the
  // cause is fixed.
  auto failed = test::run_mhla(
      "train tiny.yaml --set run.name=failed --set train.device=cpu --set train.cuda_graph=true",
      cwd);
  CHECK(failed.exit_code != 0);
  CHECK(contains(error_line(failed.output), "train.cuda_graph = true needs a CUDA device"));
  CHECK(contains(error_line(failed.output), "nothing was trained; the new run folder"));
  CHECK_FALSE(fs::exists(dir.path() / "runs" / "failed"));
  // A folder without a checkpoint (a run stopped before its first save, or one still in its
  // first epoch) is neither reused nor offered for a resume that cannot work.
  fs::create_directories(dir.path() / "runs" / "unsaved" / "checkpoints");
  auto unsaved = test::run_mhla("train tiny.yaml --set run.name=unsaved", cwd);
  CHECK(unsaved.exit_code != 0);
  CHECK(contains(error_line(unsaved.output), "holds no checkpoint to resume"));
  auto auto_named = test::run_mhla("train tiny.yaml --set train.epochs=1 --set data.train_limit=64", cwd);
  CHECK(auto_named.exit_code == 0);
  CHECK(fs::exists(dir.path() / "runs" / "tiny"));

  const auto weights = run / "checkpoints" / "best" / "model.safetensors";
  fs::resize_file(weights, fs::file_size(weights) - 1000);
  auto truncated = test::run_mhla("eval runs/first/checkpoints/best", cwd);
  CHECK(truncated.exit_code != 0);
  CHECK(contains(error_line(truncated.output), "model.safetensors: byte offset"));
  CHECK(contains(error_line(truncated.output), "truncated"));
}

TEST_CASE("cli: a classifier trained with an EMA is evaluated with it, the trained weights beside",
          "[cli]") {
  test::TempDir dir("cli-ema");
  const auto cwd = dir.str();
  test::write_text(dir.path() / "tiny.yaml", kTiny);
  auto train = test::run_mhla("train tiny.yaml --set run.name=ema --set train.ema_decay=0.9", cwd);
  INFO(train.output);
  REQUIRE(train.exit_code == 0);
  CHECK(contains(train.output, "with the EMA weights"));
  nlohmann::json eval_record;
  std::ifstream metrics(dir.path() / "runs" / "ema" / "metrics.jsonl");
  for (std::string line; std::getline(metrics, line);) {
    auto record = nlohmann::json::parse(line);
    if (record.contains("eval")) eval_record = record["eval"];
  }
  REQUIRE(eval_record.contains("accuracy_trained"));
  CHECK(eval_record["weights"] == "ema");
  // An average of different weights: the two models are not the same function.
  CHECK(eval_record["loss"].get<double>() != eval_record["loss_trained"].get<double>());

  auto json_of = [](const test::ProcessResult& r) {
    return nlohmann::json::parse(r.output.substr(r.output.rfind("{\"")));
  };
  auto ema = test::run_mhla("eval runs/ema --set data.test_limit=100", cwd);
  REQUIRE(ema.exit_code == 0);
  auto ema_json = json_of(ema);
  CHECK(ema_json["weights"] == "ema");
  CHECK(ema_json["accuracy"].get<double>() == Approx(eval_record["accuracy"].get<double>()));
  CHECK(ema_json["loss"].get<double>() == Approx(eval_record["loss"].get<double>()).epsilon(1e-6));
  auto raw = test::run_mhla("eval runs/ema --set data.test_limit=100 --raw-weights", cwd);
  REQUIRE(raw.exit_code == 0);
  auto raw_json = json_of(raw);
  CHECK(raw_json["weights"] == "trained");
  CHECK(raw_json["loss"].get<double>() ==
        Approx(eval_record["loss_trained"].get<double>()).epsilon(1e-6));
}

TEST_CASE("cli: SIGTERM writes a checkpoint and exits; --resume finishes the run", "[cli]") {
  test::TempDir dir("cli-signal");
  test::write_text(dir.path() / "long.yaml",
                   "model:\n  width: 32\n  depth: 1\n  heads: 2\n  patch_size: 4\n"
                   "attention:\n  blocks: 4\ndata:\n  train_limit: 3200\n  test_limit: 100\n"
                   "  batch_size: 32\ntrain:\n  epochs: 3\n  log_every: 5\nrun:\n  name: sig\n");
  const int status = terminate_when_ready(dir.path(), {"train", "long.yaml"},
                                         dir.path() / "runs" / "sig" / "metrics.jsonl", "train.out");
  INFO(read_file((dir.path() / "train.out").string()));
  REQUIRE(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 128 + SIGTERM);
  const auto state_file = dir.path() / "runs" / "sig" / "checkpoints" / "last" / "trainer.json";
  REQUIRE(fs::exists(state_file));
  auto state = nlohmann::json::parse(read_file(state_file.string()));
  const int64_t stopped_at = state["step"].get<int64_t>();
  CHECK(stopped_at > 0);
  CHECK(stopped_at < 300);
  CHECK(contains(read_file((dir.path() / "train.out").string()), "mhla train --resume"));

  auto resumed = test::run_mhla("train --resume runs/sig", dir.str());
  INFO(resumed.output);
  CHECK(resumed.exit_code == 0);
  CHECK(contains(resumed.output, "resuming at step " + std::to_string(stopped_at)));
  auto final_state = nlohmann::json::parse(read_file(state_file.string()));
  CHECK(final_state["step"] == 300);  // 3 epochs x 100 steps
  // A different config cannot silently continue the run.
  test::write_text(dir.path() / "other.yaml", "model:\n  depth: 2\n");
  auto mismatch = test::run_mhla("train other.yaml --resume runs/sig", dir.str());
  CHECK(mismatch.exit_code != 0);
  CHECK(contains(error_line(mismatch.output), "differs from"));
}

TEST_CASE("cli: bench attention prints one JSON line per case and rejects bad shapes", "[cli]") {
  auto r = test::run_mhla("bench attention --op mhla --blocks 4 --shape 2,2,64,32 --shape 1,2,128,64 "
                          "--device cpu --dtype fp32 --warmup 0 --iters 1");
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  std::istringstream lines(r.output);
  std::string line;
  int cases = 0;
  while (std::getline(lines, line)) {
    if (line.rfind("{", 0) != 0) continue;
    auto json = nlohmann::json::parse(line);
    CHECK(json["op"] == "mhla");
    CHECK(json["fwd_ms"].get<double>() > 0);
    CHECK(json["fwd_bwd_ms"].get<double>() > 0);
    // Bytes are deterministic (one timed iteration is not: a loaded CI core can make the first
    // forward slower than the forward+backward that follows it).
    CHECK(json["fwd_bwd_bytes"].get<double>() > json["fwd_bytes"].get<double>());
    CHECK(json["fwd_bwd_bandwidth_share"].get<double>() > 0);
    ++cases;
  }
  CHECK(cases == 2);
  auto bad = test::run_mhla("bench attention --shape 2,2,x,32 --device cpu");
  CHECK(bad.exit_code != 0);
  CHECK(contains(error_line(bad.output), "--shape 2,2,x,32: expected four positive integers"));
  auto not_divisible = test::run_mhla("bench attention --op mhla --blocks 16 --shape 1,1,100,32 --device cpu");
  CHECK(not_divisible.exit_code != 0);
  CHECK(contains(error_line(not_divisible.output), "multiple of --blocks 16"));
}

TEST_CASE("cli: bench decode times the gated-delta decode step per backend and rejects bad shapes", "[cli]") {
  auto r = test::run_mhla("bench decode --op kda --shape 2,3,32 --device cpu --warmup 1 --iters 2");
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  std::istringstream lines(r.output);
  std::vector<std::string> backends;
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind("{", 0) != 0) continue;
    auto json = nlohmann::json::parse(line);
    CHECK(json["op"] == "kda");
    CHECK(json["D"] == 32);
    CHECK(json["us_per_step"].get<double>() > 0);
    CHECK(json["state_bytes"].get<double>() == 2.0 * 2 * 3 * 32 * 32 * 4);
    CHECK(json["path"] == "reference");  // on the CPU the layers' step is the reference
    backends.push_back(json["backend"]);
  }
  CHECK(backends == std::vector<std::string>{"kernel", "reference"});
  auto bad = test::run_mhla("bench decode --shape 2,0,32 --device cpu");
  CHECK(bad.exit_code != 0);
  CHECK(contains(error_line(bad.output), "--shape 2,0,32: expected three positive integers B,H,D"));
}

TEST_CASE("cli: tokenizer, shards, a tiny GPT, eval and generate end to end", "[cli]") {
  test::TempDir dir("cli-lm");
  std::string text;
  for (int i = 0; i < 300; ++i) text += "the cat sat on the mat. the dog sat on the log. ";
  test::write_text(dir.path() / "corpus.txt", text);
  test::write_text(dir.path() / "val.txt", text.substr(0, 2000));
  auto tok = test::run_mhla("tokenizer train --vocab 300 --input corpus.txt --output tok.bpe", dir.str());
  INFO(tok.output);
  REQUIRE(tok.exit_code == 0);
  REQUIRE(test::run_mhla("tokenizer shard --tokenizer tok.bpe --input corpus.txt --output train.bin", dir.str()).exit_code == 0);
  REQUIRE(test::run_mhla("tokenizer shard --tokenizer tok.bpe --input val.txt --output val.bin", dir.str()).exit_code == 0);
  test::write_text(dir.path() / "gpt.yaml",
                   "model:\n  name: gpt\n  vocab_size: 300\n  context: 64\n  width: 32\n  depth: 2\n"
                   "  heads: 2\nattention:\n  type: linear\n  blocks: 1\ndata:\n  train_shard: train.bin\n"
                   "  val_shard: val.bin\n  tokenizer: tok.bpe\n  batch_size: 4\noptim:\n  lr: 0.003\n"
                   "train:\n  epochs: 8\n  log_every: 20\nrun:\n  name: lm\n");
  auto train = test::run_mhla("train gpt.yaml", dir.str());
  INFO(train.output);
  REQUIRE(train.exit_code == 0);
  CHECK(contains(train.output, "tok/s"));
  CHECK(contains(train.output, "bits/byte"));
  auto eval = test::run_mhla("eval runs/lm", dir.str());
  REQUIRE(eval.exit_code == 0);
  auto json = nlohmann::json::parse(eval.output.substr(eval.output.rfind("{\"")));
  CHECK(json["bits_per_byte"].get<double>() > 0);
  CHECK(json["perplexity"].get<double>() < 300);
  auto greedy = test::run_mhla("generate runs/lm --prompt 'the cat' --tokens 12 --temperature 0", dir.str());
  INFO(greedy.output);
  REQUIRE(greedy.exit_code == 0);
  CHECK(greedy.output.rfind("the cat", 0) == 0);
  CHECK(greedy.output.size() > std::string("the cat\n").size());
  auto again = test::run_mhla("generate runs/lm --prompt 'the cat' --tokens 12 --temperature 0", dir.str());
  CHECK(again.output == greedy.output);
  auto sampled = test::run_mhla("generate runs/lm --prompt 'the' --tokens 12 --temperature 1 --top-k 5 --seed 3", dir.str());
  CHECK(sampled.exit_code == 0);
  auto bad = test::run_mhla("generate runs/lm --temperature -1", dir.str());
  CHECK(bad.exit_code != 0);
  CHECK(contains(error_line(bad.output), "--temperature -1 must be >= 0"));
}

TEST_CASE("cli: a tiny DiT trains, and sample writes PNGs and a grid", "[cli]") {
  test::TempDir dir("cli-dit");
  test::write_text(dir.path() / "dit.yaml",
                   "model:\n  name: dit\n  image_size: 28\n  patch_size: 7\n  width: 32\n  depth: 1\n"
                   "  heads: 2\nattention:\n  type: mhla\n  blocks: 4\ndata:\n  train_limit: 256\n"
                   "  test_limit: 64\n  batch_size: 64\ntrain:\n  epochs: 1\n  ema_decay: 0.9\n"
                   "diffusion:\n  steps: 100\nrun:\n  name: d\n");
  auto train = test::run_mhla("train dit.yaml", dir.str());
  INFO(train.output);
  REQUIRE(train.exit_code == 0);
  CHECK(contains(train.output, "test diffusion loss"));
  auto sample = test::run_mhla("sample runs/d --n 5 --steps 4 --cfg 2 --out samples --seed 7", dir.str());
  INFO(sample.output);
  REQUIRE(sample.exit_code == 0);
  CHECK(contains(sample.output, "sampled 5/5 | "));  // progress with the rate and the time left
  CHECK(contains(sample.output, " img/s, ETA 0s"));
  const auto grid = dir.path() / "samples" / "grid.png";
  REQUIRE(std::filesystem::exists(grid));
  int pngs = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir.path() / "samples")) pngs += entry.path().extension() == ".png";
  CHECK(pngs == 6);
  auto first = read_file((dir.path() / "samples" / "sample_00000_class0.png").string());
  CHECK(first.substr(1, 3) == "PNG");
  auto be32 = [&](size_t at) {
    return (static_cast<uint8_t>(first[at]) << 24) | (static_cast<uint8_t>(first[at + 1]) << 16) |
           (static_cast<uint8_t>(first[at + 2]) << 8) | static_cast<uint8_t>(first[at + 3]);
  };
  CHECK(be32(16) == 28);  // IHDR width
  CHECK(be32(20) == 28);  // IHDR height
  auto again = test::run_mhla("sample runs/d --n 5 --steps 4 --cfg 2 --out again --seed 7", dir.str());
  REQUIRE(again.exit_code == 0);
  CHECK(read_file((dir.path() / "again" / "grid.png").string()) == read_file(grid.string()));  // DDIM eta = 0
  auto bad = test::run_mhla("sample runs/d --class 12 --out x", dir.str());
  CHECK(bad.exit_code != 0);
  CHECK(contains(error_line(bad.output), "--class 12: the model has classes 0..9"));
  auto wrong = test::run_mhla("sample runs/d --sampler euler --out x", dir.str());
  CHECK(wrong.exit_code != 0);
}

TEST_CASE("cli: FID-FMNIST from a trained feature network: hooks, cache, eval --fid", "[cli]") {
  test::TempDir dir("cli-fid");
  test::write_text(dir.path() / "net.yaml",
                   "model:\n  name: cnn\n  image_size: 32\n  width: 8\ndata:\n  train_limit: 512\n"
                   "  test_limit: 200\n  batch_size: 128\ntrain:\n  epochs: 1\nrun:\n  name: net\n");
  auto net = test::run_mhla("train net.yaml", dir.str());
  INFO(net.output);
  REQUIRE(net.exit_code == 0);
  const auto weights = dir.path() / "runs" / "net" / "checkpoints" / "best" / "model.safetensors";
  REQUIRE(fs::exists(weights));
  const std::string hash = sha256_file(weights.string());

  test::write_text(dir.path() / "dit.yaml",
                   "model:\n  name: dit\n  image_size: 32\n  patch_size: 8\n  width: 32\n  depth: 1\n"
                   "  heads: 2\nattention:\n  type: mhla\n  blocks: 4\ndata:\n  train_limit: 256\n"
                   "  test_limit: 64\n  batch_size: 64\ntrain:\n  epochs: 1\n  ema_decay: 0.9\n"
                   "diffusion:\n  steps: 100\n  sample_steps: 3\n  fid_samples: 40\n"
                   "  fid_network: runs/net\n  grid_samples: 10\nrun:\n  name: d\n");
  auto train = test::run_mhla("train dit.yaml", dir.str());
  INFO(train.output);
  REQUIRE(train.exit_code == 0);
  CHECK(contains(train.output, "FID-FMNIST (own feature network)"));
  CHECK(fs::exists(dir.path() / "runs" / "d" / "samples" / "eval_001.png"));
  const auto cache = dir.path() / "runs" / "net" / "checkpoints" / "best" / "fid_reference_train_s32_u1.safetensors";
  CHECK(fs::exists(cache));
  // The hook's result in metrics.jsonl names the metric and the network's hash.
  std::ifstream metrics(dir.path() / "runs" / "d" / "metrics.jsonl");
  std::string line, eval_line;
  while (std::getline(metrics, line)) {
    if (contains(line, "\"fid\"")) eval_line = line;
  }
  REQUIRE(!eval_line.empty());
  auto fid = nlohmann::json::parse(eval_line)["eval"]["fid"];
  CHECK(fid["metric"] == "FID-FMNIST (own feature network)");
  CHECK(fid["feature_network_sha256"] == hash);
  CHECK(fid["samples"] == 40);
  CHECK(fid["fid_fmnist"].get<double>() > 0.0);

  auto eval = test::run_mhla("eval runs/d --fid --n 30 --steps 2 --cfg 1.5", dir.str());
  INFO(eval.output);
  REQUIRE(eval.exit_code == 0);
  CHECK(contains(eval.output, "FID reference statistics from"));  // the cache, not recomputed
  auto result = nlohmann::json::parse(eval.output.substr(eval.output.rfind("{\"")));
  CHECK(result["metric"] == "FID-FMNIST (own feature network)");
  CHECK(result["feature_network_sha256"] == hash);
  CHECK(result["samples"] == 30);
  CHECK(result["cfg"] == 1.5);
  CHECK(std::isfinite(result["kid_fmnist"].get<double>()));

  // A damaged cache is recomputed (and rewritten), not fatal.
  test::write_text(cache, "garbage");
  auto again = test::run_mhla("eval runs/d --fid --n 10 --steps 2", dir.str());
  INFO(again.output);
  REQUIRE(again.exit_code == 0);
  CHECK(contains(again.output, "recomputing the reference statistics"));
  CHECK(fs::file_size(cache) > 1000);

  // A run that would need a missing feature network stops before training.
  auto early = test::run_mhla("train dit.yaml --set run.name=e --set diffusion.fid_network=nowhere", dir.str());
  CHECK(early.exit_code != 0);
  CHECK(contains(error_line(early.output), "diffusion.fid_network = 'nowhere' does not exist"));
  CHECK(!contains(early.output, "step 1/"));

  auto not_dit = test::run_mhla("eval runs/net --fid", dir.str());
  CHECK(not_dit.exit_code != 0);
  CHECK(contains(error_line(not_dit.output), "--fid needs a diffusion (dit) checkpoint"));
  auto no_net = test::run_mhla("eval runs/d --fid --n 10 --fid-network nowhere", dir.str());
  CHECK(no_net.exit_code != 0);
  CHECK(contains(error_line(no_net.output), "nowhere: FID feature network not found"));
}

TEST_CASE("cli: sweep trains every combination, keeps finished runs and writes a summary", "[cli]") {
  test::TempDir dir("cli-sweep");
  test::write_text(dir.path() / "tiny.yaml", kTiny);
  auto dry = test::run_mhla("sweep tiny.yaml --vary attention.type=softmax,mhla --vary model.depth=1,2 --dry-run",
                            dir.str());
  INFO(dry.output);
  REQUIRE(dry.exit_code == 0);
  CHECK(contains(dry.output, "runs/tiny-type=softmax-depth=1  attention.type=softmax model.depth=1"));
  CHECK(contains(dry.output, "runs/tiny-type=mhla-depth=2"));
  CHECK(!fs::exists(dir.path() / "runs" / "tiny-type=softmax-depth=1"));

  // A bad value in any combination stops the sweep before anything trains.
  auto bad = test::run_mhla("sweep tiny.yaml --vary attention.type=softmax,flash", dir.str());
  CHECK(bad.exit_code != 0);
  CHECK(contains(error_line(bad.output), "sweep run tiny-type=flash (attention.type=flash)"));
  CHECK(contains(error_line(bad.output), "flash"));
  CHECK(!fs::exists(dir.path() / "runs" / "tiny-type=softmax"));
  auto named = test::run_mhla("sweep tiny.yaml --vary run.name=a,b", dir.str());
  CHECK(named.exit_code != 0);
  CHECK(contains(error_line(named.output), "--vary run.name=a,b: a sweep names its runs itself"));
  auto malformed = test::run_mhla("sweep tiny.yaml --vary attention.type", dir.str());
  CHECK(malformed.exit_code != 0);
  CHECK(contains(error_line(malformed.output), "--vary attention.type: expected KEY=V1,V2,..."));

  const std::string command = "sweep tiny.yaml --vary attention.type=softmax,mhla --set data.test_limit=50";
  auto sweep = test::run_mhla(command, dir.str());
  INFO(sweep.output);
  REQUIRE(sweep.exit_code == 0);
  CHECK(fs::exists(dir.path() / "runs" / "tiny-type=softmax" / "checkpoints" / "best"));
  CHECK(fs::exists(dir.path() / "runs" / "tiny-type=mhla" / "checkpoints" / "best"));
  const auto summary = read_file((dir.path() / "runs" / "tiny.sweep.md").string());
  CHECK(contains(summary, "| tiny-type=mhla | mhla |"));
  CHECK(contains(summary, "accuracy"));
  std::ifstream jsonl(dir.path() / "runs" / "tiny.sweep.jsonl");
  int rows = 0;
  for (std::string line; std::getline(jsonl, line);) {
    auto row = nlohmann::json::parse(line);
    CHECK(row["eval"]["accuracy"].get<double>() >= 0.0);
    ++rows;
  }
  CHECK(rows == 2);

  // Running it again keeps the finished runs; changed settings are refused, not overwritten.
  auto again = test::run_mhla(command, dir.str());
  REQUIRE(again.exit_code == 0);
  CHECK(contains(again.output, "nothing to do"));
  auto other = test::run_mhla("sweep tiny.yaml --vary attention.type=softmax --set data.test_limit=60", dir.str());
  CHECK(other.exit_code != 0);
  CHECK(contains(error_line(other.output), "trained with other settings (data.test_limit)"));
}

TEST_CASE("cli: a sweep stopped by SIGTERM continues where it stopped when run again", "[cli]") {
  test::TempDir dir("cli-sweep-signal");
  test::write_text(dir.path() / "long.yaml",
                   "model:\n  width: 32\n  depth: 1\n  heads: 2\n  patch_size: 4\n"
                   "attention:\n  blocks: 4\ndata:\n  train_limit: 3200\n  test_limit: 100\n"
                   "  batch_size: 32\ntrain:\n  epochs: 2\n  log_every: 5\n");
  const int status =
      terminate_when_ready(dir.path(), {"sweep", "long.yaml", "--vary", "attention.type=softmax,mhla"},
                           dir.path() / "runs" / "long-type=softmax" / "metrics.jsonl", "sweep.out");
  const auto first = read_file((dir.path() / "sweep.out").string());
  INFO(first);
  REQUIRE(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 128 + SIGTERM);
  CHECK(contains(first, "the same command continues it"));
  CHECK(!fs::exists(dir.path() / "runs" / "long-type=mhla"));  // the sweep stopped with its run

  auto resumed = test::run_mhla("sweep long.yaml --vary attention.type=softmax,mhla", dir.str());
  INFO(resumed.output);
  REQUIRE(resumed.exit_code == 0);
  CHECK(contains(resumed.output, "resuming at step"));
  for (const char* run : {"long-type=softmax", "long-type=mhla"}) {
    auto state = nlohmann::json::parse(
        read_file((dir.path() / "runs" / run / "checkpoints" / "last" / "trainer.json").string()));
    CHECK(state["step"] == 200);  // 2 epochs x 100 steps
  }
}
