#include "core/config.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <fstream>
#include <functional>
#include <memory>
#include <sstream>

#include <yaml-cpp/yaml.h>

#include "core/error.h"
#include "core/registered_names.h"

namespace mhla {
namespace {

std::string mark_of(const std::string& file, const YAML::Mark& mark) {
  if (mark.line < 0) return file;
  return fmt::format("{}:{}", file, mark.line + 1);
}

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] != b[j - 1] ? 1u : 0u)});
      diagonal = up;
    }
  }
  return row[b.size()];
}

// One key of the schema, bound to a member of a Config instance.
struct Field {
  std::string path, type, doc;
  std::function<void(const std::string& text, const std::string& where)> set;
  std::function<std::string()> get;
};

int64_t parse_int(const std::string& text, const std::string& path, const std::string& where) {
  int64_t value = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc() || end != text.data() + text.size()) {
    // Accept integral floats such as 1e4 for convenience.
    char* stop = nullptr;
    double d = std::strtod(text.c_str(), &stop);
    if (!text.empty() && *stop == '\0' && std::isfinite(d) && d == std::floor(d) &&
        std::abs(d) < 9e15) {
      return static_cast<int64_t>(d);
    }
    fail("{}: {} expects an integer, got '{}'", where, path, text);
  }
  return value;
}

double parse_double(const std::string& text, const std::string& path, const std::string& where) {
  char* stop = nullptr;
  double value = std::strtod(text.c_str(), &stop);
  if (text.empty() || *stop != '\0' || !std::isfinite(value)) {
    fail("{}: {} expects a finite number, got '{}'", where, path, text);
  }
  return value;
}

bool parse_bool(const std::string& text, const std::string& path, const std::string& where) {
  std::string t = text;
  std::transform(t.begin(), t.end(), t.begin(), ::tolower);
  if (t == "true" || t == "yes" || t == "on") return true;
  if (t == "false" || t == "no" || t == "off") return false;
  fail("{}: {} expects true or false, got '{}'", where, path, text);
}

class Schema {
 public:
  explicit Schema(Config& c) : c_(c) { bind_all(); }

  const Field* find(const std::string& path) const {
    for (const auto& f : fields_)
      if (f.path == path) return &f;
    return nullptr;
  }
  bool is_section(const std::string& prefix) const {
    for (const auto& f : fields_)
      if (f.path.rfind(prefix + ".", 0) == 0) return true;
    return false;
  }
  std::string suggestion(const std::string& path) const {
    std::string best;
    size_t best_distance = 4;
    for (const auto& f : fields_) {
      size_t d = edit_distance(path, f.path);
      // also compare the last component, for keys put in the wrong section
      auto leaf = f.path.substr(f.path.rfind('.') + 1);
      auto given_leaf = path.substr(path.rfind('.') + 1);
      if (leaf == given_leaf) d = std::min<size_t>(d, 1);
      if (d < best_distance) best_distance = d, best = f.path;
    }
    return best.empty() ? "" : fmt::format(" (did you mean '{}'?)", best);
  }
  const std::vector<Field>& fields() const { return fields_; }

 private:
  void integer(const std::string& path, int64_t* target, int64_t lo, int64_t hi,
               const std::string& doc) {
    fields_.push_back({path, fmt::format("int [{}, {}]", lo, hi), doc,
                       [=](const std::string& text, const std::string& where) {
                         int64_t v = parse_int(text, path, where);
                         if (v < lo || v > hi)
                           fail("{}: {} = {} is out of range [{}, {}]", where, path, v, lo, hi);
                         *target = v;
                       },
                       [=] { return std::to_string(*target); }});
  }
  void real(const std::string& path, double* target, double lo, double hi,
            const std::string& doc) {
    fields_.push_back({path, fmt::format("float [{}, {}]", lo, hi), doc,
                       [=](const std::string& text, const std::string& where) {
                         double v = parse_double(text, path, where);
                         if (v < lo || v > hi)
                           fail("{}: {} = {} is out of range [{}, {}]", where, path, v, lo, hi);
                         *target = v;
                       },
                       [=] { return fmt::format("{}", *target); }});
  }
  void boolean(const std::string& path, bool* target, const std::string& doc) {
    fields_.push_back({path, "bool", doc,
                       [=](const std::string& text, const std::string& where) {
                         *target = parse_bool(text, path, where);
                       },
                       [=] { return *target ? std::string("true") : std::string("false"); }});
  }
  // choices: fixed list; registry: names looked up in that registry at validation time.
  void text(const std::string& path, std::string* target, std::vector<std::string> choices,
            const std::string& registry, const std::string& doc) {
    std::string type = "string";
    if (!choices.empty()) {
      type = "one of:";
      for (auto& c : choices) type += " " + c;
    } else if (!registry.empty()) {
      type = registry + " name";
    }
    fields_.push_back({path, type, doc,
                       [=](const std::string& value, const std::string& where) {
                         auto allowed = choices;
                         if (!registry.empty()) allowed = registered_names(registry);
                         if (!allowed.empty() &&
                             std::find(allowed.begin(), allowed.end(), value) == allowed.end()) {
                           std::string list;
                           for (auto& a : allowed) list += (list.empty() ? "" : ", ") + a;
                           if (registry.empty())
                             fail("{}: {} = '{}' is not allowed; choose one of: {}", where, path,
                                  value, list);
                           fail("{}: {} = '{}' is not a registered {}; registered: {}", where,
                                path, value, registry, list);
                         }
                         *target = value;
                       },
                       [=] { return *target; }});
  }

  void bind_all() {
    auto& m = c_.model;
    text("model.name", &m.name, {}, "model", "model architecture (see `mhla info`)");
    integer("model.image_size", &m.image_size, 4, 4096,
            "side of the square images the model receives (data is padded to it)");
    integer("model.in_channels", &m.in_channels, 1, 16, "image channels");
    integer("model.num_classes", &m.num_classes, 2, 100000, "classifier outputs");
    integer("model.patch_size", &m.patch_size, 1, 64, "patch side in pixels");
    integer("model.width", &m.width, 8, 8192, "embedding width");
    integer("model.depth", &m.depth, 1, 256, "number of transformer blocks");
    integer("model.heads", &m.heads, 1, 256, "attention heads (must divide width)");
    boolean("model.learn_sigma", &m.learn_sigma,
            "DiT: predict the variance too (2C outputs; loss adds the variational-bound term)");
    real("model.mlp_ratio", &m.mlp_ratio, 0.25, 16, "MLP hidden width / width");
    real("model.drop_path", &m.drop_path, 0, 0.9,
         "stochastic-depth rate of the last block (linear in depth)");
    integer("model.vocab_size", &m.vocab_size, 2, 65536, "language models: vocabulary size");
    integer("model.context", &m.context, 1, 1 << 20, "language models: context length in tokens");
    text("model.positions", &m.positions, {"rope", "learned"}, "",
         "language models: rotary (softmax layers) or learned absolute positions");
    text("model.mlp", &m.mlp, {"gelu", "gelu_tanh", "swiglu"}, "",
         "MLP kind: gelu (exact, erf), gelu_tanh (GELU's tanh form, as in DiT and GPT-2; on CUDA "
         "fused into the matrix products), swiglu (language models)");
    boolean("model.bias", &m.bias,
            "biases in the transformer blocks' attention and MLP linear layers (false: bias-free "
            "blocks, as in LLaMA and the end-to-end PyTorch peer's GPT)");

    auto& a = c_.attention;
    text("attention.type", &a.type, {}, "attention", "attention type from the registry");
    text("attention.backend", &a.backend, {"auto", "reference", "cuda", "cuda_dense", "cudnn"}, "",
         "op backend; auto = fastest available on the device");
    integer("attention.blocks", &a.blocks, 1, 1024,
            "MHLA token blocks M (a square number: tiles of the patch grid)");
    text("attention.init", &a.init, {"locality", "uniform"}, "", "MHLA mixing-matrix init");
    text("attention.normalizer", &a.normalizer, {"paper"}, "",
         "MHLA normalizer: paper = (q Σ m S) / (q Σ m z + eps)");
    boolean("attention.cpe", &a.cpe, "add a depthwise conv of v (CPE) to the attention output");
    integer("attention.cpe_kernel", &a.cpe_kernel, 1, 15, "CPE kernel size (odd)");
    boolean("attention.gate", &a.gate, "multiply the attention output by sigmoid(W_g x)");
    text("attention.pattern", &a.pattern, {}, "",
         "per-layer types, comma-separated and cycled (e.g. mhla,mhla,mhla,softmax); empty: "
         "attention.type in every layer");

    auto& d = c_.data;
    text("data.dataset", &d.dataset, {}, "dataset", "dataset from the registry");
    text("data.root", &d.root, {}, "",
         "dataset folder; auto = $MHLA_DATA_DIR/<dataset>, data/<dataset>, then the Debian package's");
    integer("data.batch_size", &d.batch_size, 1, 1 << 20, "training batch size");
    integer("data.eval_batch_size", &d.eval_batch_size, 1, 1 << 20, "evaluation batch size");
    integer("data.workers", &d.workers, 1, 256, "loader threads");
    integer("data.prefetch", &d.prefetch, 1, 1024, "batches prepared ahead");
    integer("data.crop_padding", &d.crop_padding, 0, 64,
            "random-crop padding in pixels (0 disables random crops)");
    boolean("data.hflip", &d.hflip, "random horizontal flips");
    integer("data.upscale", &d.upscale, 1, 16,
            "diffusion: centre images on model.image_size / upscale, then upsample bilinearly");
    integer("data.train_limit", &d.train_limit, 0, 1LL << 40,
            "use only the first N training images (0 = all)");
    integer("data.test_limit", &d.test_limit, 0, 1LL << 40,
            "evaluate on the first N test images only (0 = the full test split)");
    text("data.train_shard", &d.train_shard, {}, "", "language models: training token shard");
    text("data.val_shard", &d.val_shard, {}, "", "language models: validation token shard");
    text("data.tokenizer", &d.tokenizer, {}, "",
         "language models: the shards' tokenizer (bits per byte, generation)");

    auto& o = c_.optim;
    text("optim.name", &o.name, {}, "optimizer", "optimizer from the registry");
    real("optim.lr", &o.lr, 0, 10, "peak learning rate");
    real("optim.weight_decay", &o.weight_decay, 0, 10,
         "decoupled weight decay (not applied to norms, biases, embeddings, MHLA mixing)");
    real("optim.beta1", &o.beta1, 0, 0.999999, "AdamW beta1");
    real("optim.beta2", &o.beta2, 0, 0.999999999, "AdamW beta2");
    real("optim.eps", &o.eps, 1e-30, 1, "AdamW epsilon");
    real("optim.momentum", &o.momentum, 0, 0.999999, "SGD momentum (Nesterov)");
    real("optim.grad_clip", &o.grad_clip, 0, 1e9, "clip the global gradient norm (0 = off)");

    auto& s = c_.schedule;
    text("schedule.name", &s.name, {}, "schedule", "learning-rate schedule from the registry");
    real("schedule.warmup_epochs", &s.warmup_epochs, 0, 1e6, "linear warmup length in epochs");
    real("schedule.min_lr", &s.min_lr, 0, 10, "final learning rate");

    auto& t = c_.train;
    integer("train.epochs", &t.epochs, 1, 1000000, "training epochs");
    real("train.label_smoothing", &t.label_smoothing, 0, 0.99, "cross-entropy label smoothing");
    integer("train.eval_every", &t.eval_every, 0, 1000000,
            "evaluate on the full test split every N epochs (0 = only at the end)");
    integer("train.eval_every_steps", &t.eval_every_steps, 0, 1LL << 40,
            "also evaluate every N optimizer steps (0 = off); e.g. FID-FMNIST during long runs");
    integer("train.log_every", &t.log_every, 1, 1000000, "progress line every N steps");
    integer("train.checkpoint_every", &t.checkpoint_every, 0, 1000000,
            "write checkpoints/last every N epochs (0 = only at the end)");
    integer("train.seed", &t.seed, 0, (1LL << 62), "seed for init, data order and augmentation");
    text("train.device", &t.device, {"auto", "cpu", "cuda"}, "", "auto = cuda when available");
    text("train.precision", &t.precision, {"auto", "fp32", "bf16"}, "",
         "auto = bf16 autocast on CUDA, fp32 on CPU");
    integer("train.threads", &t.threads, 0, 1024, "CPU intra-op threads (0 = all cores)");
    boolean("train.ema_warmup", &t.ema_warmup,
            "ramp the EMA decay as min(ema_decay, (1 + n) / (10 + n)) over the first n updates");
    real("train.ema_decay", &t.ema_decay, 0, 0.999999,
         "EMA of the weights after every step (0 = off); saved as ema.safetensors; diffusion "
         "samples with it, classifiers are evaluated with it (trained weights' accuracy beside)");
    boolean("train.cuda_graph", &t.cuda_graph,
            "capture the training step (forward, backward, clipping, optimizer, projection) as "
            "one CUDA graph after 3 eager steps and replay it: the host stops bounding small "
            "batches; CUDA and AdamW only, fixed batch shapes");
    boolean("train.deterministic", &t.deterministic,
            "the same bits on every run of the same config and seed on one GPU: the MHLA and "
            "linear-attention kernels' cross-CTA sums in a fixed order instead of by atomics, "
            "softmax through FlashAttention's ordered backward (slower), cuDNN's deterministic "
            "algorithms; GPU kernels that can only sum with atomics (causal MHLA past its trained "
            "length, the dense and cluster families) stop the run with the reason");

    auto& f = c_.diffusion;
    text("diffusion.schedule", &f.schedule, {"linear", "cosine"}, "", "DDPM beta schedule");
    integer("diffusion.steps", &f.steps, 2, 100000, "diffusion timesteps T");
    real("diffusion.label_dropout", &f.label_dropout, 0, 1,
         "share of training labels replaced by the null class (classifier-free guidance)");
    integer("diffusion.sample_steps", &f.sample_steps, 1, 100000, "DDIM steps when sampling");
    real("diffusion.eta", &f.eta, 0, 1, "DDIM stochasticity (0 = deterministic)");
    real("diffusion.cfg_scale", &f.cfg_scale, 0, 100, "classifier-free guidance scale (1 = none)");
    integer("diffusion.fid_samples", &f.fid_samples, 0, 1 << 24,
            "FID-FMNIST and KID on this many DDIM samples at every evaluation (0 = off)");
    text("diffusion.fid_network", &f.fid_network, {}, "",
         "run or checkpoint folder of the FID feature network (configs/fid_net_fmnist.yaml)");
    integer("diffusion.grid_samples", &f.grid_samples, 0, 1024,
            "write a grid of this many samples to samples/ in the run folder at every evaluation");

    auto& r = c_.run;
    text("run.name", &r.name, {}, "",
         "run folder name under run.root (empty: the config file's name, made unique)");
    text("run.root", &r.root, {}, "", "folder that holds run folders");
  }

  Config& c_;
  std::vector<Field> fields_;
};

void walk(const YAML::Node& node, const std::string& prefix, const std::string& file,
          Schema& schema, Config& config) {
  for (const auto& item : node) {
    const YAML::Node& key_node = item.first;
    const YAML::Node& value = item.second;
    std::string key = key_node.as<std::string>();
    std::string path = prefix.empty() ? key : prefix + "." + key;
    std::string where = mark_of(file, key_node.Mark());
    if (const Field* field = schema.find(path)) {
      if (!value.IsScalar()) {
        fail("{}: {} expects a single value ({}), got {}", where, path, field->type,
             value.IsNull() ? "nothing" : (value.IsMap() ? "a mapping" : "a list"));
      }
      field->set(value.Scalar(), where);
      config.origin[path] = where;
    } else if (schema.is_section(path)) {
      if (!value.IsMap()) fail("{}: '{}' is a section and expects a mapping of keys", where, path);
      walk(value, path, file, schema, config);
    } else {
      fail("{}: unknown key '{}'{}", where, path, schema.suggestion(path));
    }
  }
}

void apply_override(const std::string& assignment, Schema& schema, Config& config) {
  std::string where = "--set " + assignment;
  auto eq = assignment.find('=');
  if (eq == std::string::npos || eq == 0)
    fail("{}: expected key=value (for example model.depth=6)", where);
  std::string path = assignment.substr(0, eq);
  std::string value = assignment.substr(eq + 1);
  const Field* field = schema.find(path);
  if (!field) fail("{}: unknown key '{}'{}", where, path, schema.suggestion(path));
  // Unquote a YAML-quoted string value so --set run.name="a b" works like in a file.
  if (value.size() >= 2 && (value.front() == '"' || value.front() == '\'') &&
      value.back() == value.front())
    value = value.substr(1, value.size() - 2);
  field->set(value, where);
  config.origin[path] = where;
}

bool is_square(int64_t n) {
  auto r = static_cast<int64_t>(std::llround(std::sqrt(static_cast<double>(n))));
  return r * r == n;
}

void validate(const Config& c) {
  if (c.model.image_size % c.data.upscale != 0) {
    fail("{}: data.upscale = {} must divide model.image_size = {}", c.where("data.upscale"),
         c.data.upscale, c.model.image_size);
  }
  // (The CNN has no attention heads.)
  if (c.model.name != "cnn" && c.model.width % c.model.heads != 0)
    fail("{}: model.heads = {} must divide model.width = {}", c.where("model.heads"),
         c.model.heads, c.model.width);
  if (!c.attention.pattern.empty()) {
    const auto names = registered_names("attention");
    std::string item;
    std::stringstream list(c.attention.pattern);
    while (std::getline(list, item, ',')) {
      if (std::find(names.begin(), names.end(), item) == names.end()) {
        fail("{}: attention.pattern names '{}', not a registered attention", c.where("attention.pattern"), item);
      }
    }
  }
  // Image models tile the patch grid into sqrt(M) x sqrt(M) tiles; GPT blocks are 1-D.
  if (c.model.name != "gpt" && c.attention.type == "mhla" && !is_square(c.attention.blocks))
    fail("{}: attention.blocks = {} must be a square number (2-D tiles of the patch grid)",
         c.where("attention.blocks"), c.attention.blocks);
  if (c.model.mlp == "swiglu" && c.model.name != "gpt")
    fail("{}: model.mlp = swiglu is for language models (model.name = gpt); {} takes gelu or "
         "gelu_tanh", c.where("model.mlp"), c.model.name);
  if (c.attention.cpe_kernel % 2 == 0)
    fail("{}: attention.cpe_kernel = {} must be odd", c.where("attention.cpe_kernel"),
         c.attention.cpe_kernel);
  if (c.schedule.min_lr > c.optim.lr)
    fail("{}: schedule.min_lr = {} exceeds optim.lr = {}", c.where("schedule.min_lr"),
         c.schedule.min_lr, c.optim.lr);
  if (c.train.cuda_graph && c.optim.name != "adamw")
    fail("{}: train.cuda_graph = true needs optim.name = adamw (optimizer '{}' has no kernel that "
         "reads its learning rate from the device)", c.where("train.cuda_graph"), c.optim.name);
  if (c.run.name.find('/') != std::string::npos || c.run.name == "." || c.run.name == "..")
    fail("{}: run.name = '{}' must be a plain folder name", c.where("run.name"), c.run.name);
}

Config parse_node(const YAML::Node& root, const std::string& name,
                  const std::vector<std::string>& overrides) {
  Config config;
  config.source_file = name;
  Schema schema(config);
  if (root.IsDefined() && !root.IsNull()) {
    if (!root.IsMap()) fail("{}: the config must be a mapping of sections", mark_of(name, root.Mark()));
    walk(root, "", name, schema, config);
  }
  for (const auto& assignment : overrides) apply_override(assignment, schema, config);
  validate(config);
  return config;
}

YAML::Node load_yaml(const std::string& text, const std::string& name) {
  try {
    return YAML::Load(text);
  } catch (const YAML::Exception& e) {
    fail("{}: malformed YAML: {}", mark_of(name, e.mark), e.msg);
  }
}

}  // namespace

std::string Config::where(const std::string& key) const {
  auto it = origin.find(key);
  if (it != origin.end()) return it->second;
  return source_file.empty() ? "(default)" : source_file + " (default)";
}

Config parse_config(const std::string& yaml_text, const std::string& name,
                    const std::vector<std::string>& overrides) {
  return parse_node(load_yaml(yaml_text, name), name, overrides);
}

Config load_config(const std::string& yaml_path, const std::vector<std::string>& overrides) {
  if (yaml_path.empty()) return parse_node(YAML::Node(), "", overrides);
  std::ifstream in(yaml_path, std::ios::binary);
  if (!in) fail("{}: cannot open config file", yaml_path);
  std::stringstream buffer;
  buffer << in.rdbuf();
  return parse_node(load_yaml(buffer.str(), yaml_path), yaml_path, overrides);
}

std::string dump_config(const Config& config) {
  Config copy = config;
  Schema schema(copy);
  YAML::Emitter out;
  out << YAML::BeginMap;
  std::string section;
  for (const auto& field : schema.fields()) {
    auto dot = field.path.find('.');
    std::string s = field.path.substr(0, dot);
    if (s != section) {
      if (!section.empty()) out << YAML::EndMap;
      out << YAML::Key << s << YAML::Value << YAML::BeginMap;
      section = s;
    }
    std::string value = field.get();
    out << YAML::Key << field.path.substr(dot + 1) << YAML::Value;
    if (field.type == "string" || field.type.rfind("one of", 0) == 0 ||
        field.type.find(" name") != std::string::npos)
      out << YAML::DoubleQuoted << value;
    else
      out << value;
  }
  if (!section.empty()) out << YAML::EndMap;
  out << YAML::EndMap;
  return std::string(out.c_str()) + "\n";
}

std::vector<ConfigKeyDoc> config_key_docs() {
  Config defaults;
  Schema schema(defaults);
  std::vector<ConfigKeyDoc> docs;
  for (const auto& f : schema.fields()) docs.push_back({f.path, f.type, f.get(), f.doc});
  return docs;
}

std::vector<std::string> config_differences(const Config& a, const Config& b) {
  Config ca = a, cb = b;
  Schema sa(ca), sb(cb);
  std::vector<std::string> diff;
  for (size_t i = 0; i < sa.fields().size(); ++i)
    if (sa.fields()[i].get() != sb.fields()[i].get()) diff.push_back(sa.fields()[i].path);
  return diff;
}

}  // namespace mhla
