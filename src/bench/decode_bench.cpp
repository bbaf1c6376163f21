#include "bench/decode_bench.h"

#include <cmath>

#include "attention/gated_delta.h"
#include "attention/gated_delta_decode.h"
#include "bench/timing.h"
#include "core/error.h"

namespace mhla {

nlohmann::json bench_decode(const DecodeBenchCase& c, const torch::Device& device,
                            double copy_bandwidth) {
  if (c.op != "gated_deltanet" && c.op != "kda") {
    fail("bench decode: --op {} (gated_deltanet, kda)", c.op);
  }
  if (c.backend != "kernel" && c.backend != "reference") {
    fail("bench decode: --backend {} (kernel, reference)", c.backend);
  }
  torch::manual_seed(0);
  auto f32 = torch::TensorOptions().dtype(torch::kFloat32).device(device);
  const int64_t b = c.batch, h = c.heads, d = c.head_dim;
  auto unit = [](torch::Tensor x) { return x / x.norm(2, {-1}, true); };
  auto q = unit(torch::randn({b, h, d}, f32)).to(c.dtype);
  auto k = unit(torch::randn({b, h, d}, f32)).to(c.dtype);
  auto v = torch::randn({b, h, d}, f32).to(c.dtype);
  auto beta = torch::rand({b, h}, f32);
  auto g = c.op == "kda" ? -torch::rand({b, h, d}, f32) : -torch::rand({b, h}, f32);
  auto state = torch::randn({b, h, d, d}, f32) * 0.1;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  torch::NoGradGuard no_grad;
  // What "kernel" runs here: the layers' step takes the reference where the kernel does not apply
  // (CPU, fp64, Dk > 256), and the result says so.
  const std::string path =
      c.backend == "kernel" && delta_rule_decode_uses_kernel(state, q, k, v, beta, g)
          ? "cuda kernel"
          : "reference";
  const double ms = mean_ms_per_call(device, c.warmup, c.iters, [&] {
    if (c.backend == "kernel") {
      delta_rule_decode(state, q, k, v, beta, g, scale);
    } else {
      delta_rule_step(state, q, k, v, beta, g, scale);
    }
  });
  const double state_bytes = 2.0 * static_cast<double>(b * h * d * d) * 4.0;
  return {{"op", c.op},
          {"backend", c.backend},
          {"path", path},
          {"device", device.str()},
          {"B", b},
          {"H", h},
          {"D", d},
          {"dtype", c10::toString(c.dtype)},
          {"us_per_step", ms * 1e3},
          {"state_bytes", state_bytes},
          {"bandwidth_share", state_bytes / (ms * 1e-3) / copy_bandwidth},
          {"copy_bandwidth_gbs", copy_bandwidth / 1e9}};
}

}  // namespace mhla
