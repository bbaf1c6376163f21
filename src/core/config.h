#pragma once
// The typed run configuration: YAML file + `--set key=value` overrides -> Config.
// Every key has a default, a type, a documented meaning and (where it makes sense) a range;
// an unknown key, a wrong type or an out-of-range value is an error naming the key path and
// where it came from (`file:line` or the --set argument).
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace mhla {

struct ModelConfig {
  std::string name = "deit";
  int64_t image_size = 32;  // side of the (square) input images the model receives
  int64_t in_channels = 1;
  int64_t num_classes = 10;
  int64_t patch_size = 2;
  int64_t width = 192;
  int64_t depth = 12;
  int64_t heads = 3;
  bool learn_sigma = false;  // DiT: also predict the variance (improved-DDPM bound term)
  double mlp_ratio = 4.0;
  double drop_path = 0.1;
  // Language models (gpt)
  int64_t vocab_size = 8192;
  int64_t context = 1024;
  std::string positions = "rope";
  std::string mlp = "gelu";
  bool bias = true;  // biases in the blocks' attention and MLP linear layers
};

struct AttentionConfig {
  std::string type = "mhla";
  std::string backend = "auto";
  int64_t blocks = 16;  // MHLA: number of token blocks M (a square number: 2-D tiles)
  std::string init = "locality";
  std::string normalizer = "paper";
  bool cpe = false;
  int64_t cpe_kernel = 3;
  bool gate = false;
  std::string pattern;  // comma-separated types cycled over layers; empty: `type` everywhere
};

struct DataConfig {
  std::string dataset = "fashion_mnist";
  std::string root = "auto";
  int64_t batch_size = 256;
  int64_t eval_batch_size = 1000;
  int64_t workers = 4;
  int64_t prefetch = 6;
  int64_t crop_padding = 2;
  bool hflip = true;
  int64_t train_limit = 0;
  int64_t upscale = 1;  // diffusion: images centred on image_size / upscale, then upsampled
  int64_t test_limit = 0;
  // Language models: token shards and the tokenizer that made them
  std::string train_shard = "data/text/train.bin";
  std::string val_shard = "data/text/val.bin";
  std::string tokenizer = "data/text/tokenizer-8192.bpe";
};

struct OptimConfig {
  std::string name = "adamw";
  double lr = 1e-3;
  double weight_decay = 0.05;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double momentum = 0.9;
  double grad_clip = 1.0;
};

struct ScheduleConfig {
  std::string name = "cosine";
  double warmup_epochs = 1.0;
  double min_lr = 1e-5;
};

struct TrainConfig {
  int64_t epochs = 10;
  double label_smoothing = 0.1;
  int64_t eval_every = 1;
  int64_t eval_every_steps = 0;  // also evaluate every N steps (0 = off)
  int64_t log_every = 50;
  int64_t checkpoint_every = 1;
  int64_t seed = 0;
  std::string device = "auto";
  std::string precision = "auto";
  int64_t threads = 0;
  double ema_decay = 0.0;  // 0: no EMA of the weights
  bool ema_warmup = true;  // decay ramps as min(decay, (1 + n) / (10 + n))
  bool cuda_graph = false;  // capture the training step as one CUDA graph and replay it
  bool deterministic = false;  // the same bits on every run (core/determinism.h)
};

struct DiffusionConfig {
  std::string schedule = "linear";
  int64_t steps = 1000;
  double label_dropout = 0.1;  // classifier-free guidance: labels replaced by the null class
  int64_t sample_steps = 50;   // DDIM steps for evaluation samples
  double eta = 0.0;
  double cfg_scale = 1.0;      // guidance scale for evaluation samples (1 = none)
  int64_t fid_samples = 0;     // FID-FMNIST at every evaluation on this many samples (0 = off)
  std::string fid_network = "runs/fid_net_fmnist";
  int64_t grid_samples = 0;    // sample grid (PNG) into the run folder at every evaluation
};

struct RunConfig {
  std::string name;  // empty: derived from the config file's name
  std::string root = "runs";
};

struct Config {
  ModelConfig model;
  AttentionConfig attention;
  DataConfig data;
  OptimConfig optim;
  ScheduleConfig schedule;
  TrainConfig train;
  DiffusionConfig diffusion;
  RunConfig run;

  std::string source_file;                    // the YAML file it was read from ("" if none)
  std::map<std::string, std::string> origin;  // key path -> "file:line" or "--set ..."

  // Where a key's value came from, for error messages ("(default)" when never set).
  std::string where(const std::string& key) const;
};

// One documented key of the schema, for `mhla info --config` and the README.
struct ConfigKeyDoc {
  std::string path, type, default_value, doc;
};

// Reads a YAML file (no file: defaults only), applies `key=value` overrides, validates.
Config load_config(const std::string& yaml_path, const std::vector<std::string>& overrides);
// Parses YAML text (for tests and for checkpoints' embedded config); `name` labels errors.
Config parse_config(const std::string& yaml_text, const std::string& name,
                    const std::vector<std::string>& overrides);
// The fully resolved config as YAML (every key, in schema order).
std::string dump_config(const Config& config);
std::vector<ConfigKeyDoc> config_key_docs();
// Keys whose values differ between two configs.
std::vector<std::string> config_differences(const Config& a, const Config& b);

}  // namespace mhla
