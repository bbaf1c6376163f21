// Language modelling on token shards: next-token cross-entropy over windows of model.context
// tokens; evaluation over the whole validation shard gives loss, perplexity and bits per byte.
#include <cmath>
#include <filesystem>

#include "core/device.h"
#include "core/error.h"
#include "data/batch_loader.h"
#include "data/token_shard.h"
#include "text/bpe_tokenizer.h"
#include "train/cross_entropy.h"
#include "train/task.h"

namespace mhla {
namespace {

// [count, length + 1] int64 token windows starting at `starts`, copied out of a shard.
torch::Tensor gather_windows(const TokenShard& shard, const std::vector<int64_t>& starts,
                             int64_t length, bool pin) {
  auto options = torch::TensorOptions().dtype(torch::kInt64).pinned_memory(pin);
  auto out = torch::empty({static_cast<int64_t>(starts.size()), length + 1}, options);
  int64_t* dst = out.data_ptr<int64_t>();
  const uint16_t* src = shard.tokens();
  for (size_t w = 0; w < starts.size(); ++w) {
    for (int64_t i = 0; i <= length; ++i) dst[w * (length + 1) + i] = src[starts[w] + i];
  }
  return out;
}

class WindowStream : public BatchStream {
 public:
  WindowStream(const TokenShard& shard, std::vector<int64_t> order, int64_t batch, int64_t length,
               int64_t start_batch, int64_t batches, torch::Device device)
      : shard_(shard), order_(std::move(order)), batch_(batch), length_(length),
        next_(start_batch), batches_(batches), device_(device) {}

  std::optional<TrainBatch> next() override {
    if (next_ >= batches_) return std::nullopt;
    std::vector<int64_t> starts;
    for (int64_t i = 0; i < batch_; ++i) starts.push_back(order_[next_ * batch_ + i] * length_);
    auto windows = gather_windows(shard_, starts, length_, device_.is_cuda()).to(device_, true);
    return TrainBatch{windows.narrow(1, 0, length_), windows.narrow(1, 1, length_), next_++};
  }

 private:
  const TokenShard& shard_;
  std::vector<int64_t> order_;
  int64_t batch_, length_, next_, batches_;
  torch::Device device_;
};

std::string checked_path(const Config& config, const std::string& key, const std::string& path) {
  if (!std::filesystem::exists(path)) {
    fail("{}: {} = '{}' does not exist (scripts/prepare_text.sh makes the default corpus)",
         config.where(key), key, path);
  }
  return path;
}

class LanguageModelTask : public Task {
 public:
  LanguageModelTask(const Config& config, const torch::Device& device)
      : config_(config), device_(device),
        train_(checked_path(config, "data.train_shard", config.data.train_shard)),
        val_(checked_path(config, "data.val_shard", config.data.val_shard)),
        tokenizer_(BpeTokenizer::load(checked_path(config, "data.tokenizer", config.data.tokenizer))) {
    const auto& m = config.model;
    for (const TokenShard* shard : {&train_, &val_}) {
      if (shard->vocab_size() > m.vocab_size) {
        fail("{}: model.vocab_size = {} is smaller than the vocabulary of {} ({})",
             config.where("model.vocab_size"), m.vocab_size, shard->path(), shard->vocab_size());
      }
    }
    if (tokenizer_.vocab_size() != train_.vocab_size()) {
      fail("{}: the tokenizer has {} tokens but {} was made with {}", config.data.tokenizer,
           tokenizer_.vocab_size(), train_.path(), train_.vocab_size());
    }
    windows_ = (train_.size() - 1) / m.context;
    steps_ = windows_ / config.data.batch_size;
    if (steps_ == 0) {
      fail("{}: data.batch_size = {} windows of {} tokens exceed the {} tokens of {}",
           config.where("data.batch_size"), config.data.batch_size, m.context, train_.size(),
           train_.path());
    }
    if (val_.size() < 2) fail("{}: the validation shard holds fewer than 2 tokens", val_.path());
  }

  std::string describe() const override {
    return fmt::format("{} train / {} validation tokens, windows of {}", train_.size(),
                       val_.size(), config_.model.context);
  }
  const char* unit() const override { return "tok"; }
  int64_t samples_per_step() const override {
    return config_.data.batch_size * config_.model.context;
  }
  int64_t steps_per_epoch() const override { return steps_; }

  std::unique_ptr<BatchStream> epoch(int64_t epoch, int64_t start_batch) override {
    auto order = BatchLoader::epoch_order(windows_, /*shuffle=*/true,
                                          static_cast<uint64_t>(config_.train.seed), epoch);
    return std::make_unique<WindowStream>(train_, std::move(order), config_.data.batch_size,
                                          config_.model.context, start_batch, steps_, device_);
  }

  torch::Tensor loss(const torch::Tensor& logits, const torch::Tensor& target) const override {
    return mean_cross_entropy(logits, target);
  }

  EvalReport evaluate(Model& model) override {
    const auto start_time = std::chrono::steady_clock::now();
    const bool was_training = model.is_training();
    model.eval();
    torch::NoGradGuard no_grad;
    const bool bf16 = uses_bf16_autocast(config_, device_);
    const int64_t length = config_.model.context, total = val_.size();
    double nll = 0.0;
    int64_t tokens = 0;
    auto run = [&](const std::vector<int64_t>& starts, int64_t window) {
      auto windows = gather_windows(val_, starts, window, false).to(device_);
      torch::Tensor logits;
      {
        AutocastScope autocast(device_, bf16);
        logits = model.forward(windows.narrow(1, 0, window));
      }
      auto summed = summed_cross_entropy(logits, windows.narrow(1, 1, window));
      nll += summed.item<double>();
      tokens += static_cast<int64_t>(starts.size()) * window;
    };
    // Every token after the first is predicted once: full windows in batches, then the rest.
    const int64_t full = (total - 1) / length;
    std::vector<int64_t> starts;
    for (int64_t w = 0; w < full; ++w) {
      starts.push_back(w * length);
      if (static_cast<int64_t>(starts.size()) == config_.data.batch_size || w + 1 == full) {
        run(starts, length);
        starts.clear();
      }
    }
    const int64_t rest = total - 1 - full * length;
    if (rest > 0) run({full * length}, rest);
    // Bits per byte: the predicted tokens' bytes (special tokens have none).
    int64_t bytes = 0;
    const uint16_t* ids = val_.tokens();
    const auto eot = tokenizer_.special("<|endoftext|>");
    for (int64_t i = 1; i < total; ++i) {
      if (eot && ids[i] == *eot) continue;
      bytes += static_cast<int64_t>(tokenizer_.token_bytes(ids[i]).size());
    }
    if (was_training) model.train();
    const double loss = nll / static_cast<double>(tokens);
    const double bpb = nll / std::log(2.0) / static_cast<double>(std::max<int64_t>(bytes, 1));
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start_time).count();
    return {{{"loss", loss}, {"perplexity", std::exp(loss)}, {"bits_per_byte", bpb},
             {"tokens", tokens}, {"bytes", bytes}, {"split", "val"}},
            -loss,
            fmt::format("val loss {:.4f}, perplexity {:.2f}, {:.4f} bits/byte ({} tokens), {:.1f}s",
                        loss, std::exp(loss), bpb, tokens, seconds)};
  }

 private:
  Config config_;
  torch::Device device_;
  TokenShard train_, val_;
  BpeTokenizer tokenizer_;
  int64_t windows_ = 0, steps_ = 0;
};

}  // namespace

void register_language_model_task(Registry<TaskEntry>& registry) {
  registry.add("language_model",
               {"tokens -> next tokens: cross-entropy; val loss, perplexity, bits per byte",
                [](const Config& c, const torch::Device& d) {
                  return std::make_unique<LanguageModelTask>(c, d);
                }});
}

}  // namespace mhla
