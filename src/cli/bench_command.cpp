#include <iostream>
#include <sstream>

#include "attention/attention_type.h"
#include "bench/attention_bench.h"
#include "cli/commands.h"
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
};

AttentionBenchCase parse_shape(const std::string& text, AttentionBenchCase base) {
  std::stringstream in(text);
  std::string part;
  std::vector<int64_t> values;
  while (std::getline(in, part, ',')) {
    try {
      size_t used = 0;
      values.push_back(std::stoll(part, &used));
      if (used != part.size() || values.back() <= 0) throw std::invalid_argument(part);
    } catch (const std::exception&) {
      fail("--shape {}: expected four positive integers B,H,N,D", text);
    }
  }
  if (values.size() != 4) fail("--shape {}: expected four positive integers B,H,N,D", text);
  base.batch = values[0];
  base.heads = values[1];
  base.tokens = values[2];
  base.head_dim = values[3];
  return base;
}

int run_bench(const BenchArgs& args) {
  torch::Device device = args.device == "cpu" || (args.device == "auto" && !torch::cuda::is_available())
                             ? torch::Device(torch::kCPU)
                             : torch::Device(torch::kCUDA, 0);
  if (device.is_cuda() && !torch::cuda::is_available()) fail("--device cuda: no CUDA device");
  AttentionBenchCase base;
  base.op = args.op;
  base.blocks = args.blocks;
  base.causal = args.causal;
  base.warmup = args.warmup;
  base.iters = args.iters;
  base.dtype = args.dtype == "bf16"   ? torch::kBFloat16
               : args.dtype == "fp16" ? torch::kFloat16
                                      : torch::kFloat32;
  const double bandwidth = measure_copy_bandwidth(device);
  const auto shapes = args.shapes.empty() ? std::vector<std::string>{"16,6,4096,64"} : args.shapes;
  for (const auto& backend : args.backends) {
    for (const auto& shape : shapes) {
      AttentionBenchCase c = parse_shape(shape, base);
      c.backend = backend;
      if (attention_registry().get(c.op).uses_blocks && c.tokens % c.blocks != 0) {
        fail("--shape {}: N must be a multiple of --blocks {}", shape, c.blocks);
      }
      std::cout << bench_attention(c, device, bandwidth).dump() << std::endl;
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
  return {app, [args] { return run_bench(*args); }};
}

}  // namespace mhla
