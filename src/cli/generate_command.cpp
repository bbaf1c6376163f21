#include <iostream>

#include "cli/commands.h"
#include "core/device.h"
#include "core/error.h"
#include "models/gpt.h"
#include "text/bpe_tokenizer.h"
#include "train/checkpoint.h"

namespace mhla {
namespace {

struct GenerateArgs {
  std::string checkpoint;
  std::string prompt;
  int64_t tokens = 200;
  double temperature = 0.8;
  int64_t top_k = 50;
  int64_t seed = 0;
  std::string tokenizer;
  std::vector<std::string> overrides;
};

// Picks the next token from logits [vocab]: greedy at temperature 0, else top-k sampling.
int64_t sample(torch::Tensor logits, double temperature, int64_t top_k, torch::Generator& rng) {
  logits = logits.to(torch::kFloat32);
  if (temperature == 0.0) return logits.argmax().item<int64_t>();
  logits = logits / temperature;
  if (top_k > 0 && top_k < logits.size(0)) {
    auto threshold = std::get<0>(logits.topk(top_k)).min();
    logits = logits.masked_fill(logits < threshold, -INFINITY);
  }
  auto probabilities = torch::softmax(logits, 0);
  return at::multinomial(probabilities, 1, /*replacement=*/false, rng).item<int64_t>();
}

int run_generate(const GenerateArgs& args) {
  if (args.temperature < 0) fail("--temperature {} must be >= 0", args.temperature);
  if (args.top_k < 0) fail("--top-k {} must be >= 0 (0 = no limit)", args.top_k);
  Checkpoint checkpoint = read_checkpoint(args.checkpoint, args.overrides);
  const Config& config = checkpoint.config;
  if (config.model.name != "gpt") {
    fail("{}: model '{}' is not a language model; generate needs a gpt checkpoint", checkpoint.dir,
         config.model.name);
  }
  const torch::Device device = resolve_device(config);
  auto base = model_registry().get(config.model.name).make(config);
  load_model_weights(*base, checkpoint.weights, checkpoint.dir + "/model.safetensors");
  auto model = std::dynamic_pointer_cast<Gpt>(base);
  model->to(device);
  model->eval();
  auto tokenizer = BpeTokenizer::load(args.tokenizer.empty() ? config.data.tokenizer : args.tokenizer);
  auto prompt = tokenizer.encode(args.prompt);
  const auto eot = tokenizer.special("<|endoftext|>");
  if (prompt.empty()) prompt.push_back(eot ? *eot : 0);  // start of a document
  torch::NoGradGuard no_grad;
  torch::Generator rng = at::detail::createCPUGenerator(static_cast<uint64_t>(args.seed));
  auto states = model->new_decode_states();
  auto options = torch::TensorOptions().dtype(torch::kInt64).device(device);
  torch::Tensor logits;
  const bool bf16 = uses_bf16_autocast(config, device);
  auto feed = [&](int64_t id) {
    AutocastScope autocast(device, bf16);
    logits = model->step(torch::full({1, 1}, id, options), states).view({-1}).cpu();
  };
  for (int32_t id : prompt) feed(id);  // prefill, keeping the recurrent state / KV cache
  std::vector<int32_t> generated;
  std::cout << args.prompt << std::flush;
  for (int64_t i = 0; i < args.tokens; ++i) {
    const int64_t next = sample(logits, args.temperature, args.top_k, rng);
    if (eot && next == *eot) break;
    generated.push_back(static_cast<int32_t>(next));
    // Print whole UTF-8 characters only: flush what decodes so far.
    std::cout << tokenizer.decode({static_cast<int32_t>(next)}) << std::flush;
    feed(next);
  }
  std::cout << std::endl;
  return 0;
}

}  // namespace

Command add_generate_command(CLI::App& parent) {
  auto args = std::make_shared<GenerateArgs>();
  auto* app = parent.add_subcommand("generate", "sample text from a language-model checkpoint");
  app->add_option("checkpoint", args->checkpoint, "checkpoint folder or run folder")->required();
  app->add_option("--prompt", args->prompt, "text to continue (empty: a new document)");
  app->add_option("--tokens", args->tokens, "tokens to generate (stops early at <|endoftext|>)")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 20))
      ->capture_default_str();
  app->add_option("--temperature", args->temperature, "0 = greedy")->capture_default_str();
  app->add_option("--top-k", args->top_k, "sample among the k most likely (0 = all)")
      ->capture_default_str();
  app->add_option("--seed", args->seed, "sampling seed")->capture_default_str();
  app->add_option("--tokenizer", args->tokenizer, "tokenizer file (default: the run's data.tokenizer)");
  app->add_option("--set", args->overrides, "override a config key")->type_name("KEY=VALUE");
  return {app, [args] { return run_generate(*args); }};
}

}  // namespace mhla
