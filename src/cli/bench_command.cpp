#include <iostream>
#include <sstream>

#include "attention/attention_type.h"
#include "bench/attention_bench.h"
#include "bench/decode_bench.h"
#include "cli/commands.h"
#include "core/determinism.h"
#include "core/environment.h"
#include "core/error.h"

namespace mhla {
namespace {

struct BenchArgs {
  std::string op = "mhla";
  std::vector<std::string> backends = {"reference"};
  std::vector<std::string> shapes;
  int64_t blocks = 16;
  bool causal = false;
  std::string dtype = "bf16";
  std::string device = "auto";
  int warmup = 3, iters = 10;
  bool deterministic = false;
};

struct DecodeArgs {
  std::string op = "gated_deltanet";
  std::vector<std::string> backends = {"kernel", "reference"};
  std::vector<std::string> shapes;
  std::string dtype = "bf16";
  std::string device = "auto";
  int warmup = 10, iters = 100;
};

torch::ScalarType parse_dtype(const std::string& name) {
  return name == "bf16" ? torch::kBFloat16 : name == "fp16" ? torch::kFloat16 : torch::kFloat32;
}

torch::Device bench_device(const std::string& name) {
  torch::Device device = name == "cpu" || (name == "auto" && !torch::cuda::is_available())
                             ? torch::Device(torch::kCPU)
                             : torch::Device(torch::kCUDA, 0);
  if (device.is_cuda() && !torch::cuda::is_available()) fail("--device cuda: no CUDA device");
  return device;
}

// "--shape" values: `count` positive integers separated by commas, named by `layout` in errors.
std::vector<int64_t> parse_dims(const std::string& text, size_t count, const char* words,
                                const char* layout) {
  std::stringstream in(text);
  std::string part;
  std::vector<int64_t> values;
  while (std::getline(in, part, ',')) {
    try {
      size_t used = 0;
      values.push_back(std::stoll(part, &used));
      if (used != part.size() || values.back() <= 0) throw std::invalid_argument(part);
    } catch (const std::exception&) {
      values.clear();
      break;
    }
  }
  if (values.size() != count) {
    fail("--shape {}: expected {} positive integers {}", text, words, layout);
  }
  return values;
}

AttentionBenchCase parse_shape(const std::string& text, AttentionBenchCase base) {
  const auto values = parse_dims(text, 4, "four", "B,H,N,D");
  base.batch = values[0];
  base.heads = values[1];
  base.tokens = values[2];
  base.head_dim = values[3];
  return base;
}

// A bench line says which kernel switches were set (A/B runs compare lines of one binary), and
// a misspelt switch is named on stderr before any timing.
nlohmann::json with_switches(nlohmann::json row) {
  row["switches"] = environment_switches_set();
  return row;
}
void warn_idle_switches() {
  for (const auto& warning : environment_switch_warnings())
    std::cerr << "warning: " << warning << "\n";
}

int run_decode_bench(const DecodeArgs& args) {
  warn_idle_switches();
  const torch::Device device = bench_device(args.device);
  const double bandwidth = measure_copy_bandwidth(device);
  const auto shapes = args.shapes.empty() ? std::vector<std::string>{"64,8,128"} : args.shapes;
  for (const auto& backend : args.backends) {
    for (const auto& shape : shapes) {
      const auto values = parse_dims(shape, 3, "three", "B,H,D");
      DecodeBenchCase c;
      c.op = args.op;
      c.backend = backend;
      c.batch = values[0], c.heads = values[1], c.head_dim = values[2];
      c.dtype = parse_dtype(args.dtype);
      c.warmup = args.warmup, c.iters = args.iters;
      std::cout << with_switches(bench_decode(c, device, bandwidth)).dump() << std::endl;
    }
  }
  return 0;
}

int run_bench(const BenchArgs& args) {
  warn_idle_switches();
  const torch::Device device = bench_device(args.device);
  AttentionBenchCase base;
  base.op = args.op;
  base.blocks = args.blocks;
  base.causal = args.causal;
  base.warmup = args.warmup;
  base.iters = args.iters;
  base.dtype = parse_dtype(args.dtype);
  const DeterministicSumsScope deterministic(args.deterministic);
  const double bandwidth = measure_copy_bandwidth(device);
  const auto shapes = args.shapes.empty() ? std::vector<std::string>{"16,6,4096,64"} : args.shapes;
  for (const auto& backend : args.backends) {
    for (const auto& shape : shapes) {
      AttentionBenchCase c = parse_shape(shape, base);
      c.backend = backend;
      if (attention_registry().get(c.op).uses_blocks && c.tokens % c.blocks != 0) {
        fail("--shape {}: N must be a multiple of --blocks {}", shape, c.blocks);
      }
      std::cout << with_switches(bench_attention(c, device, bandwidth)).dump() << std::endl;
    }
  }
  return 0;
}

}  // namespace

Command add_bench_command(CLI::App& parent) {
  auto args = std::make_shared<BenchArgs>();
  auto* bench = parent.add_subcommand("bench", "benchmarks (one JSON line per case)");
  bench->require_subcommand(1);
  auto* app = bench->add_subcommand("attention", "time an attention op: forward, forward+backward");
  app->add_option("--op", args->op, "attention type from the registry")->capture_default_str();
  app->add_option("--backend", args->backends, "backend(s): reference, cuda, ...")
      ->capture_default_str();
  app->add_option("--shape", args->shapes, "B,H,N,D (repeatable; default 16,6,4096,64)");
  app->add_option("--blocks", args->blocks, "MHLA blocks M")->capture_default_str();
  app->add_flag("--causal", args->causal, "causal attention");
  app->add_option("--dtype", args->dtype, "bf16, fp16 or fp32")
      ->check(CLI::IsMember({"bf16", "fp16", "fp32"}))
      ->capture_default_str();
  app->add_option("--device", args->device, "auto, cpu or cuda")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}))
      ->capture_default_str();
  app->add_option("--warmup", args->warmup, "untimed calls first")->capture_default_str();
  app->add_option("--iters", args->iters, "timed calls (mean reported)")->capture_default_str();
  app->add_flag("--deterministic", args->deterministic,
                "as with train.deterministic: ordered sums where the kernels have them, an error "
                "where they do not");

  auto decode_args = std::make_shared<DecodeArgs>();
  auto* decode = bench->add_subcommand(
      "decode", "time one gated-delta-rule decoding step (fp32 state updated in place)");
  decode->add_option("--op", decode_args->op, "gated_deltanet or kda")
      ->check(CLI::IsMember({"gated_deltanet", "kda"}))
      ->capture_default_str();
  decode
      ->add_option("--backend", decode_args->backends,
                   "kernel (the layers' step: the GPU kernel where it runs) and/or reference")
      ->check(CLI::IsMember({"kernel", "reference"}))
      ->capture_default_str();
  decode->add_option("--shape", decode_args->shapes, "B,H,D (repeatable; default 64,8,128)");
  decode->add_option("--dtype", decode_args->dtype, "bf16, fp16 or fp32")
      ->check(CLI::IsMember({"bf16", "fp16", "fp32"}))
      ->capture_default_str();
  decode->add_option("--device", decode_args->device, "auto, cpu or cuda")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}))
      ->capture_default_str();
  decode->add_option("--warmup", decode_args->warmup, "untimed steps first")->capture_default_str();
  decode->add_option("--iters", decode_args->iters, "timed steps (mean reported)")
      ->capture_default_str();
  // One Command: whichever leaf was parsed runs.
  return {bench, [args, decode_args, decode] {
            return decode->parsed() ? run_decode_bench(*decode_args) : run_bench(*args);
          }};
}

}  // namespace mhla
