#include <chrono>
#include <filesystem>
#include <iostream>

#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "core/atomic_file.h"
#include "core/error.h"
#include "core/logging.h"
#include "data/token_shard.h"
#include "text/bpe_tokenizer.h"

namespace mhla {
namespace {

struct TokenizerArgs {
  std::vector<std::string> inputs;
  int64_t vocab = 8192;
  std::string output;
  std::string tokenizer;
  std::string text;
};

// "gpt2:FOLDER" loads OpenAI's files, anything else our own format.
BpeTokenizer load_any(const std::string& spec) {
  if (spec.rfind("gpt2:", 0) == 0) return BpeTokenizer::load_gpt2(spec.substr(5));
  return BpeTokenizer::load(spec);
}

int run_train(const TokenizerArgs& args) {
  std::vector<std::string> texts;
  int64_t bytes = 0;
  for (const auto& path : args.inputs) {
    texts.push_back(read_file(path));
    bytes += static_cast<int64_t>(texts.back().size());
  }
  logger().info("training a {}-token byte-level BPE on {} file(s), {} bytes", args.vocab,
                texts.size(), bytes);
  const auto start = std::chrono::steady_clock::now();
  int64_t reported = 0;
  auto tokenizer = BpeTokenizer::train(texts, args.vocab, [&](int64_t done, int64_t total) {
    if (done - reported >= 1000 || done == total) {
      reported = done;
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      logger().info("merges {}/{} ({:.0f}/s)", done, total, done / std::max(s, 1e-9));
    }
  });
  tokenizer.save(args.output);
  // Report compression on the training text (bytes per token) as a sanity number.
  int64_t tokens = 0;
  for (const auto& text : texts) tokens += static_cast<int64_t>(tokenizer.encode(text).size());
  nlohmann::json summary = {{"output", args.output},
                            {"vocab_size", tokenizer.vocab_size()},
                            {"training_bytes", bytes},
                            {"training_tokens", tokens},
                            {"bytes_per_token", static_cast<double>(bytes) / std::max<int64_t>(tokens, 1)}};
  std::cout << summary.dump() << std::endl;
  return 0;
}

int run_encode(const TokenizerArgs& args) {
  auto tokenizer = load_any(args.tokenizer);
  auto ids = tokenizer.encode(args.text);
  if (tokenizer.decode(ids) != args.text) fail("internal: the encoding does not decode back");
  std::cout << nlohmann::json(ids).dump() << std::endl;
  return 0;
}

// Encodes each input file as one document followed by <|endoftext|> into a token shard.
int run_shard(const TokenizerArgs& args) {
  auto tokenizer = load_any(args.tokenizer);
  const auto eot = tokenizer.special("<|endoftext|>");
  if (!eot) fail("{}: the tokenizer has no <|endoftext|> token", args.tokenizer);
  std::vector<int32_t> tokens;
  int64_t bytes = 0;
  for (const auto& path : args.inputs) {
    const std::string text = read_file(path);
    bytes += static_cast<int64_t>(text.size());
    auto ids = tokenizer.encode(text);
    tokens.insert(tokens.end(), ids.begin(), ids.end());
    tokens.push_back(*eot);
  }
  write_token_shard(args.output, tokens, tokenizer.vocab_size());
  nlohmann::json summary = {{"output", args.output}, {"documents", args.inputs.size()},
                            {"bytes", bytes}, {"tokens", tokens.size()},
                            {"vocab_size", tokenizer.vocab_size()}};
  std::cout << summary.dump() << std::endl;
  return 0;
}

}  // namespace

Command add_tokenizer_command(CLI::App& parent) {
  auto args = std::make_shared<TokenizerArgs>();
  auto* tokenizer = parent.add_subcommand("tokenizer", "train and use byte-level BPE tokenizers");
  tokenizer->require_subcommand(1);
  auto* train = tokenizer->add_subcommand("train", "learn a byte-level BPE from text files");
  train->add_option("--input", args->inputs, "text file(s)")->required()->check(CLI::ExistingFile);
  train->add_option("--vocab", args->vocab, "vocabulary size incl. 256 bytes and <|endoftext|>")
      ->capture_default_str();
  train->add_option("--output", args->output, "tokenizer file to write")->required();
  auto* encode = tokenizer->add_subcommand("encode", "print the ids of a text (JSON)");
  encode->add_option("--tokenizer", args->tokenizer, "a tokenizer file, or gpt2:FOLDER")->required();
  encode->add_option("--text", args->text, "text to encode")->required();
  auto* shard = tokenizer->add_subcommand(
      "shard", "tokenize text files (one document each, <|endoftext|> after each) into a shard");
  shard->add_option("--tokenizer", args->tokenizer, "a tokenizer file, or gpt2:FOLDER")->required();
  shard->add_option("--input", args->inputs, "text file(s)")->required()->check(CLI::ExistingFile);
  shard->add_option("--output", args->output, "token shard to write")->required();
  // One Command: whichever leaf was parsed runs.
  Command command;
  command.app = tokenizer;
  command.run = [args, train, encode, shard] {
    if (train->parsed()) return run_train(*args);
    if (shard->parsed()) return run_shard(*args);
    if (encode->parsed()) return run_encode(*args);
    return 1;
  };
  return command;
}

}  // namespace mhla
