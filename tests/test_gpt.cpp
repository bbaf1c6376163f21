#include <cmath>
#include <filesystem>
#include <fstream>

#include "attention/attention_type.h"
#include "catch_compat.h"
#include "core/config.h"
#include "data/token_shard.h"
#include "models/gpt.h"
#include "test_helpers.h"
#include "text/bpe_tokenizer.h"
#include "train/checkpoint.h"
#include "train/run_folder.h"
#include "train/task.h"
#include "train/trainer.h"

using namespace mhla;
namespace fs = std::filesystem;

namespace {

Config tiny_gpt(const std::string& attention, std::vector<std::string> extra = {}) {
  std::vector<std::string> o = {"model.name=gpt",     "model.vocab_size=300",
                                "model.context=80",   "model.width=32",
                                "model.depth=2",      "model.heads=2",
                                "attention.blocks=2", "attention.type=" + attention};
  o.insert(o.end(), extra.begin(), extra.end());
  return parse_config("", "gpt.yaml", o);
}

// A small corpus with a learnable pattern, its tokenizer and shards in `dir`.
std::vector<std::string> write_corpus(const fs::path& dir) {
  std::string text;
  for (int i = 0; i < 400; ++i) text += "the cat sat on the mat. the dog sat on the log. ";
  auto tokenizer = BpeTokenizer::train({text}, 300);
  tokenizer.save((dir / "tok.bpe").string());
  auto ids = tokenizer.encode(text);
  std::vector<int32_t> train(ids.begin(), ids.begin() + ids.size() * 9 / 10);
  std::vector<int32_t> val(ids.begin() + ids.size() * 9 / 10, ids.end());
  write_token_shard((dir / "train.bin").string(), train, tokenizer.vocab_size());
  write_token_shard((dir / "val.bin").string(), val, tokenizer.vocab_size());
  return {"data.train_shard=" + (dir / "train.bin").string(),
          "data.val_shard=" + (dir / "val.bin").string(),
          "data.tokenizer=" + (dir / "tok.bpe").string()};
}

}  // namespace

TEST_CASE("gpt: every causal attention type (and a hybrid) gives a causal model", "[model]") {
  std::vector<std::string> configs;
  for (const auto& name : attention_registry().names()) {
    const auto& modes = attention_registry().get(name).causal_modes;
    if (std::find(modes.begin(), modes.end(), true) != modes.end()) configs.push_back(name);
  }
  REQUIRE(configs.size() >= 5);
  configs.push_back("pattern");
  for (const auto& name : configs) {
    INFO(name);
    Config c = name == "pattern" ? tiny_gpt("softmax", {"attention.pattern=mhla,softmax"})
                                 : tiny_gpt(name);
    if (name == "pattern")
      CHECK(layer_attention_types(c) == std::vector<std::string>{"mhla", "softmax"});
    torch::manual_seed(3);
    auto model = model_registry().get("gpt").make(c);
    model->eval();
    auto tokens = torch::randint(0, 300, {2, 80}, torch::kLong);
    auto changed = tokens.clone();
    changed.narrow(1, 50, 30).random_(0, 300);
    auto a = model->forward(tokens), b = model->forward(changed);
    CHECK(a.sizes() == std::vector<int64_t>{2, 80, 300});
    CHECK(torch::allclose(a.narrow(1, 0, 50), b.narrow(1, 0, 50), 1e-5, 1e-5));
    CHECK_FALSE(torch::allclose(a.narrow(1, 50, 30), b.narrow(1, 50, 30), 1e-3, 1e-3));
    a.sum().backward();
    for (const auto& item : model->named_parameters()) {
      INFO(item.key());
      CHECK(item.value().grad().defined());
    }
  }
}

TEST_CASE("gpt: the head is tied to the token embedding; positions by option", "[model]") {
  auto model = model_registry().get("gpt").make(tiny_gpt("softmax"));
  for (const auto& item : model->named_parameters())
    CHECK(item.key().find("head") == std::string::npos);
  auto learned = model_registry().get("gpt").make(tiny_gpt("softmax", {"model.positions=learned"}));
  CHECK(learned->named_parameters().contains("position_embedding.weight"));
  CHECK_FALSE(model->named_parameters().contains("position_embedding.weight"));
  auto swiglu = model_registry().get("gpt").make(tiny_gpt("softmax", {"model.mlp=swiglu"}));
  CHECK(swiglu->named_parameters().contains("blocks.0.mlp.w3.weight"));
  CHECK_THROWS(learned->forward(torch::zeros({1, 81}, torch::kLong)));  // beyond learned positions
}

TEST_CASE("gpt: bias-free blocks with learned positions are the PyTorch peer's GPT", "[model]") {
  // ../shared/bench/peers_e2e.py: V 8192, d 512, 8 layers, 8 heads, T 1024, learned positions,
  // bias-free linear layers, tied head: 29,901,824 parameters.
  auto config =
      parse_config("", "gpt.yaml",
                   {"model.name=gpt", "model.vocab_size=8192", "model.context=1024",
                    "model.width=512", "model.depth=8", "model.heads=8", "model.positions=learned",
                    "model.bias=false", "attention.type=softmax"});
  auto model = model_registry().get("gpt").make(config);
  int64_t count = 0;
  for (const auto& p : model->parameters()) count += p.numel();
  CHECK(count == 29901824);
  for (const auto& item : model->named_parameters()) {
    const auto& name = item.key();
    const bool norm = name.find("norm") != std::string::npos;
    if (!norm) CHECK(name.find(".bias") == std::string::npos);
  }
  // The default keeps biases (GPT-2 style).
  auto with_bias = model_registry().get("gpt").make(tiny_gpt("softmax"));
  CHECK(with_bias->named_parameters().contains("blocks.0.attn.qkv.bias"));
  CHECK(with_bias->named_parameters().contains("blocks.0.mlp.fc1.bias"));
  auto tiny = model_registry().get("gpt").make(tiny_gpt("softmax", {"model.bias=false"}));
  auto logits = tiny->forward(torch::randint(0, 300, {2, 9}, torch::kLong));
  CHECK(logits.sizes() == torch::IntArrayRef({2, 9, 300}));
}

TEST_CASE("gpt: evaluation gives the exact loss, perplexity and bits per byte of a uniform model",
          "[train]") {
  test::TempDir dir("lm-eval");
  auto data = write_corpus(dir.path());
  data.push_back("data.batch_size=8");
  Config c = tiny_gpt("softmax", data);
  auto task = task_registry().get("language_model").make(c, torch::kCPU);
  auto model = model_registry().get("gpt").make(c);
  {
    torch::NoGradGuard no_grad;
    model->named_parameters()["norm.weight"].zero_();  // final norm outputs 0: uniform logits
  }
  auto report = task->evaluate(*model);
  const double ln_v = std::log(300.0);
  CHECK(report.metrics["loss"].get<double>() == Approx(ln_v).epsilon(1e-6));
  CHECK(report.metrics["perplexity"].get<double>() == Approx(300.0).epsilon(1e-5));
  // Bytes of every predicted token, from the tokenizer independently.
  auto tokenizer = BpeTokenizer::load((dir.path() / "tok.bpe").string());
  TokenShard val((dir.path() / "val.bin").string());
  int64_t bytes = 0;
  for (int64_t i = 1; i < val.size(); ++i)
    bytes += static_cast<int64_t>(tokenizer.token_bytes(val.tokens()[i]).size());
  CHECK(report.metrics["tokens"].get<int64_t>() == val.size() - 1);
  CHECK(report.metrics["bytes"].get<int64_t>() == bytes);
  CHECK(report.metrics["bits_per_byte"].get<double>() ==
        Approx(ln_v * (val.size() - 1) / std::log(2.0) / bytes).epsilon(1e-6));
}

TEST_CASE("gpt: a tiny model learns a repetitive corpus; bad shard paths are named", "[train]") {
  test::TempDir dir("lm-train");
  auto data = write_corpus(dir.path());
  data.insert(data.end(), {"data.batch_size=8", "train.epochs=40", "optim.lr=3e-3",
                           "train.log_every=50", "train.eval_every=0", "run.root=" + dir.str(),
                           "run.name=lm", "schedule.warmup_epochs=0.2"});
  Config c = tiny_gpt("mhla", data);
  auto run_dir = create_run_folder(c);
  Trainer trainer(c, run_dir, false);
  auto outcome = trainer.run();
  INFO(outcome.final_eval.dump());
  CHECK(outcome.final_eval["loss"].get<double>() < 1.0);  // uniform would be ln 300 = 5.7
  Config missing =
      tiny_gpt("softmax", {"data.train_shard=/nowhere/train.bin", "data.batch_size=8"});
  CHECK(test::contains(
      test::error_of([&] { task_registry().get("language_model").make(missing, torch::kCPU); }),
      "data.train_shard = '/nowhere/train.bin' does not exist"));
}

TEST_CASE("gpt: token-by-token decoding gives the full forward's logits, for every attention type",
          "[model]") {
  std::vector<std::string> configs;
  for (const auto& name : attention_registry().names()) {
    const auto& modes = attention_registry().get(name).causal_modes;
    if (std::find(modes.begin(), modes.end(), true) != modes.end()) configs.push_back(name);
  }
  configs.push_back("pattern");
  for (const auto& name : configs) {
    for (const char* positions : {"rope", "learned"}) {
      INFO(name << ", " << positions << " positions");
      // 150 tokens: three MHLA blocks of 64 with M = 2, so the long-sequence policy runs too.
      std::vector<std::string> extra = {"model.context=150",
                                        std::string("model.positions=") + positions};
      if (name == "pattern") extra.push_back("attention.pattern=gated_deltanet,mhla,softmax");
      if (name == "pattern") extra.push_back("model.depth=3");
      Config c = tiny_gpt(name == "pattern" ? "softmax" : name, extra);
      torch::manual_seed(5);
      auto base = model_registry().get("gpt").make(c);
      auto model = std::dynamic_pointer_cast<Gpt>(base);
      REQUIRE(model);
      model->to(torch::kFloat64);
      model->eval();
      torch::NoGradGuard no_grad;
      auto tokens = torch::randint(0, 300, {2, 150}, torch::kLong);
      auto full = model->forward(tokens);
      auto states = model->new_decode_states();
      std::vector<torch::Tensor> stepped;
      for (int64_t t = 0; t < 150; ++t)
        stepped.push_back(model->step(tokens.narrow(1, t, 1), states));
      auto decoded = torch::cat(stepped, 1);
      CHECK(test::relative_error(decoded, full) < 1e-8);  // float64; a wrong step shows at 1e-2
    }
  }
}

// The language-model step (fused QKV + rotary, residual + norm and cross-entropy kernels) under a
// CUDA graph: the same losses and weights as eager steps, to rounding (AdamW's epsilon raised as
// in the DeiT graph test, so near-zero gradient entries do not move by 2 lr on a sign flip).
// Three epochs of about 7 steps: the cosine rate changes enough per step that a replay with a
// stale rate would show.
TEST_CASE("gpt: CUDA-graph steps train the same weights as eager steps", "[train][gpu]") {
  if (!torch::cuda::is_available()) {
    WARN("no CUDA device: skipped");
    return;
  }
  test::TempDir dir("lm-graph");
  const auto data = write_corpus(dir.path());
  auto run = [&](const std::string& name, bool graph) {
    auto settings = data;
    settings.insert(
        settings.end(),
        {"model.width=64", "train.device=cuda", "data.batch_size=8", "train.epochs=3",
         "optim.lr=2e-3", "optim.eps=1e-3", "schedule.warmup_epochs=0", "train.log_every=1",
         "train.eval_every=0", "run.root=" + dir.str(), "run.name=" + name,
         std::string("train.cuda_graph=") + (graph ? "true" : "false")});
    Config c = tiny_gpt("softmax", settings);
    auto run_dir = create_run_folder(c);
    Trainer trainer(c, run_dir, false);
    trainer.stop_after_step(16);  // 3 eager steps, then the capture and its replays
    CHECK(trainer.run().steps == 16);
    CHECK(trainer.step_graph_captured() == graph);
    const auto losses = test::logged_losses(run_dir);
    return std::make_pair(model_tensors(trainer.model()), losses);
  };
  auto [eager, eager_losses] = run("eager", false);
  auto [graphed, graphed_losses] = run("graphed", true);
  REQUIRE(eager_losses.size() == 16);
  REQUIRE(graphed_losses.size() == 16);
  for (size_t i = 0; i < eager_losses.size(); ++i) {
    INFO("step " << i + 1);
    CHECK(std::abs(graphed_losses[i] - eager_losses[i]) <= 1e-3 * std::abs(eager_losses[i]));
  }
  double worst = 0;
  for (const auto& [name, t] : eager) {
    INFO(name);
    const double diff = (graphed.at(name) - t).abs().max().item<double>();
    worst = std::max(worst, diff);
    CHECK(diff <= 5e-4);
  }
  WARN("GPT, CUDA graph vs eager after 16 steps: largest weight difference " << worst);
}

// train.deterministic for language models: two GPU runs of a GPT with causal MHLA (its CUDA
// kernels inside the trained length: two 64-token blocks; the query pass's diagonal and the
// mix backward's pair products summed in order), causal linear attention and softmax end with
// the same losses and weight bits.
TEST_CASE("gpt: with train.deterministic two GPU runs end with the same bits", "[train][gpu]") {
  if (!torch::cuda::is_available()) {
    WARN("no CUDA device: skipped");
    return;
  }
  test::TempDir dir("lm-deterministic");
  const auto data = write_corpus(dir.path());
  for (const char* type : {"mhla", "linear", "softmax"}) {
    INFO("attention.type = " << type);
    auto run = [&](const std::string& name) {
      auto settings = data;
      settings.insert(settings.end(), {"model.context=128", "model.width=64", "train.device=cuda",
                                       "data.batch_size=8", "train.epochs=3", "optim.lr=2e-3",
                                       "schedule.warmup_epochs=0", "train.log_every=1",
                                       "train.eval_every=0", "train.deterministic=true",
                                       "run.root=" + dir.str(), "run.name=" + name + "_" + type});
      Config c = tiny_gpt(type, settings);
      auto run_dir = create_run_folder(c);
      Trainer trainer(c, run_dir, false);
      trainer.stop_after_step(12);
      CHECK(trainer.run().steps == 12);
      return std::make_pair(model_tensors(trainer.model()), test::logged_losses(run_dir));
    };
    auto [first, first_losses] = run("first");
    auto [second, second_losses] = run("second");
    REQUIRE(first_losses.size() == 12);
    CHECK(first_losses == second_losses);
    const auto bits = test::compare_bits(first, second);
    CHECK(bits.differing == std::vector<std::string>{});  // names any that differ
    WARN("GPT " << type << ": two deterministic runs, largest weight difference "
                << bits.largest_difference);
  }
}
