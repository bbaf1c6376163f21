#include "train/checkpoint.h"

#include <filesystem>

#include <nlohmann/json.hpp>
#include <unistd.h>

#include "core/atomic_file.h"
#include "core/error.h"

namespace mhla {

namespace fs = std::filesystem;

namespace {

std::string to_hex(const torch::Tensor& bytes) {
  static const char* digits = "0123456789abcdef";
  auto b = bytes.contiguous();
  const uint8_t* p = b.data_ptr<uint8_t>();
  std::string out;
  out.reserve(b.numel() * 2);
  for (int64_t i = 0; i < b.numel(); ++i) {
    out.push_back(digits[p[i] >> 4]);
    out.push_back(digits[p[i] & 15]);
  }
  return out;
}

torch::Tensor from_hex(const std::string& hex, const std::string& file) {
  if (hex.size() % 2) fail("{}: RNG state has odd length", file);
  auto out = torch::empty({static_cast<int64_t>(hex.size() / 2)}, torch::kUInt8);
  uint8_t* p = out.data_ptr<uint8_t>();
  auto value = [&](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    fail("{}: RNG state is not hex", file);
  };
  for (size_t i = 0; i < hex.size(); i += 2) p[i / 2] = (value(hex[i]) << 4) | value(hex[i + 1]);
  return out;
}

}  // namespace

std::string capture_rng_state(bool cuda) {
  at::Generator generator = at::globalContext().defaultGenerator(cuda ? at::kCUDA : at::kCPU);
  std::lock_guard<std::mutex> lock(generator.mutex());
  return to_hex(generator.get_state());
}

void restore_rng_state(const std::string& hex, bool cuda, const std::string& file) {
  at::Generator generator = at::globalContext().defaultGenerator(cuda ? at::kCUDA : at::kCPU);
  std::lock_guard<std::mutex> lock(generator.mutex());
  try {
    generator.set_state(from_hex(hex, file));
  } catch (const c10::Error& e) {
    fail("{}: RNG state does not fit this build's generator ({})", file,
         e.what_without_backtrace());
  }
}

TensorMap model_tensors(Model& model) {
  TensorMap out;
  for (const auto& item : model.named_parameters()) out[item.key()] = item.value().detach();
  for (const auto& item : model.named_buffers()) out[item.key()] = item.value().detach();
  return out;
}

void load_model_weights(Model& model, const TensorMap& weights, const std::string& file) {
  torch::NoGradGuard no_grad;
  auto expected = model_tensors(model);
  for (auto& [name, tensor] : expected) {
    auto it = weights.find(name);
    if (it == weights.end()) fail("{}: tensor '{}' is missing (does the config match?)", file, name);
    if (it->second.sizes() != tensor.sizes()) {
      fail("{}: tensor '{}' has shape {}, the model needs {}", file, name,
           c10::str(it->second.sizes()), c10::str(tensor.sizes()));
    }
    tensor.copy_(it->second);
  }
  for (const auto& [name, tensor] : weights) {
    if (!expected.count(name)) fail("{}: unexpected tensor '{}' (does the config match?)", file, name);
  }
}

void save_checkpoint(const std::string& dir, const Config& config, Model& model,
                     const Optimizer* optimizer, const TrainerState& state, const TensorMap& ema) {
  const fs::path target(dir);
  const fs::path staging =
      target.parent_path() / ("." + target.filename().string() + ".staging-" +
                              std::to_string(::getpid()));
  remove_tree(staging.string());
  fs::create_directories(staging);
  TensorMap weights;
  for (auto& [name, t] : model_tensors(model)) weights[name] = t.to(torch::kFloat32);
  save_safetensors((staging / "model.safetensors").string(), weights,
                   {{"format", "mhla"}, {"model", config.model.name},
                    {"attention", config.attention.type}});
  if (optimizer) {
    save_safetensors((staging / "optimizer.safetensors").string(), optimizer->state(),
                     {{"optimizer", config.optim.name}});
  }
  if (!ema.empty()) {
    save_safetensors((staging / "ema.safetensors").string(), ema, {{"format", "mhla-ema"}});
  }
  nlohmann::json json = {{"step", state.step},
                         {"epoch", state.epoch},
                         {"batch_in_epoch", state.batch_in_epoch},
                         {"best_score", state.best_score},
                         {"best_step", state.best_step},
                         {"train_seconds", state.train_seconds},
                         {"cpu_rng", state.cpu_rng},
                         {"cuda_rng", state.cuda_rng}};
  write_file_atomic((staging / "trainer.json").string(), json.dump(1) + "\n");
  write_file_atomic((staging / "config.yaml").string(), dump_config(config));
  fsync_directory(staging.string());
  replace_directory_atomic(staging.string(), dir);
}

std::string resolve_checkpoint_dir(const std::string& path) {
  if (!fs::exists(path)) fail("{}: no such checkpoint or run folder", path);
  if (fs::exists(fs::path(path) / "model.safetensors")) return path;
  for (const char* name : {"best", "last"}) {
    auto candidate = fs::path(path) / "checkpoints" / name;
    if (fs::exists(candidate / "model.safetensors")) return candidate.string();
  }
  fail("{}: not a checkpoint folder (no model.safetensors) and no checkpoints/best or "
       "checkpoints/last inside", path);
}

Checkpoint read_checkpoint(const std::string& path, const std::vector<std::string>& overrides) {
  Checkpoint checkpoint;
  checkpoint.dir = resolve_checkpoint_dir(path);
  const fs::path dir(checkpoint.dir);
  const std::string config_path = (dir / "config.yaml").string();
  if (!fs::exists(config_path)) fail("{}: missing (incomplete checkpoint)", config_path);
  checkpoint.config = load_config(config_path, overrides);
  checkpoint.weights = load_safetensors((dir / "model.safetensors").string());
  const auto optimizer_path = dir / "optimizer.safetensors";
  if (fs::exists(optimizer_path)) checkpoint.optimizer = load_safetensors(optimizer_path.string());
  const auto ema_path = dir / "ema.safetensors";
  if (fs::exists(ema_path)) checkpoint.ema = load_safetensors(ema_path.string());
  const std::string state_path = (dir / "trainer.json").string();
  if (fs::exists(state_path)) {
    try {
      auto json = nlohmann::json::parse(read_file(state_path));
      auto& s = checkpoint.state;
      s.step = json.at("step").get<int64_t>();
      s.epoch = json.at("epoch").get<int64_t>();
      s.batch_in_epoch = json.at("batch_in_epoch").get<int64_t>();
      s.best_score = json.at("best_score").get<double>();
      s.best_step = json.at("best_step").get<int64_t>();
      s.train_seconds = json.at("train_seconds").get<double>();
      s.cpu_rng = json.at("cpu_rng").get<std::string>();
      s.cuda_rng = json.at("cuda_rng").get<std::string>();
    } catch (const nlohmann::json::parse_error& e) {
      fail("{}: byte offset {}: malformed JSON ({})", state_path, e.byte, e.what());
    } catch (const nlohmann::json::exception& e) {
      fail("{}: {}", state_path, e.what());
    }
  }
  return checkpoint;
}

}  // namespace mhla
