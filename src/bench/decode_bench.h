#pragma once
// Times one decoding step of the gated delta rule (gated DeltaNet: one gate per head; KDA: one
// per key dimension) for a batch of sequences: the layers' step (the GPU kernel where it runs,
// `delta_rule_decode`) or the plain-LibTorch reference step. Reports which code ran ("path"),
// microseconds per step and the fp32 state's bytes (read once, written once) against the copy
// bandwidth.
#include <string>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

namespace mhla {

struct DecodeBenchCase {
  std::string op = "gated_deltanet";    // or "kda"
  std::string backend = "kernel";       // "kernel" (the layers' step) or "reference"
  int64_t batch = 64, heads = 8, head_dim = 128;
  torch::ScalarType dtype = torch::kBFloat16;
  int warmup = 10, iters = 100;
};

nlohmann::json bench_decode(const DecodeBenchCase& c, const torch::Device& device,
                            double copy_bandwidth);

}  // namespace mhla
