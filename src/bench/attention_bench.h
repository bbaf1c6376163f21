#pragma once
// The bench harness: times any registered attention op and backend the same way (forward, and
// forward + backward), and relates the bytes it must move to the device's copy bandwidth
// measured in the same process.
#include <string>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

namespace mhla {

struct AttentionBenchCase {
  std::string op = "mhla";
  std::string backend = "reference";
  int64_t batch = 16, heads = 6, tokens = 4096, head_dim = 64;
  int64_t blocks = 16;  // MHLA blocks (N % blocks == 0)
  bool causal = false;
  torch::ScalarType dtype = torch::kBFloat16;
  int warmup = 3, iters = 10;
};

// Device-to-device copy bandwidth in bytes/s (bytes read + bytes written), or host memcpy
// bandwidth on the CPU.
double measure_copy_bandwidth(const torch::Device& device);

// One JSON object: op, backend, shape, fwd_ms, fwd_bwd_ms, tokens_per_s (fwd+bwd), bytes moved
// (inputs read once, outputs written once) and their share of the copy bandwidth.
nlohmann::json bench_attention(const AttentionBenchCase& c, const torch::Device& device,
                               double copy_bandwidth);

}  // namespace mhla
