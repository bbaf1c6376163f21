#include "bench/attention_bench.h"

#include "bench/timing.h"

#include "attention/attention_type.h"
#include "core/determinism.h"
#include "core/error.h"

namespace mhla {

double measure_copy_bandwidth(const torch::Device& device) {
  const int64_t bytes = device.is_cuda() ? (int64_t{1} << 30) : (int64_t{1} << 28);
  auto src = torch::empty({bytes}, torch::TensorOptions().dtype(torch::kUInt8).device(device));
  auto dst = torch::empty_like(src);
  src.fill_(1);
  const double ms = mean_ms_per_call(device, 2, 10, [&] { dst.copy_(src); });
  return 2.0 * static_cast<double>(bytes) / (ms * 1e-3);
}

nlohmann::json bench_attention(const AttentionBenchCase& c, const torch::Device& device,
                               double copy_bandwidth) {
  const auto& type = attention_registry().get(c.op);
  const OpFn& op = select_backend(c.op, type, c.backend, device, "bench", c.causal);
  auto options = torch::TensorOptions().dtype(c.dtype).device(device);
  const std::vector<int64_t> shape = {c.batch, c.tokens, c.heads, c.head_dim};
  auto q = torch::randn(shape, options).requires_grad_(true);
  auto k = torch::randn(shape, options).requires_grad_(true);
  auto v = torch::randn(shape, options).requires_grad_(true);
  OpArgs args = type.make_args({c.batch, c.tokens, c.heads, c.head_dim, c.blocks, c.causal},
                               torch::TensorOptions().device(device));
  for (auto* t : {&args.mixing, &args.beta, &args.gate}) {
    if (t->defined()) t->requires_grad_(true);
  }
  auto grad_out = torch::randn(shape, options);

  const double fwd_ms = mean_ms_per_call(device, c.warmup, c.iters, [&] {
    torch::NoGradGuard no_grad;
    op(q, k, v, args);
  });
  // Gradients are dropped before each call, as the peer scripts do (`t.grad = None`): otherwise
  // autograd adds every new gradient into the old one, three extra elementwise passes.
  std::vector<torch::Tensor*> leaves = {&q, &k, &v};
  for (auto* t : {&args.mixing, &args.beta, &args.gate}) {
    if (t->defined()) leaves.push_back(t);
  }
  const double fwd_bwd_ms = mean_ms_per_call(device, c.warmup, c.iters, [&] {
    for (auto* t : leaves) t->mutable_grad().reset();
    auto out = op(q, k, v, args);
    out.backward(grad_out);
  });
  // Floor traffic: forward reads q, k, v and writes o (4 tensors); backward reads q, k, v, o, dO
  // (o for the normalizer's gradient) and writes dq, dk, dv (8 more).
  const double tensor_bytes =
      static_cast<double>(c.batch * c.tokens * c.heads * c.head_dim) * torch::elementSize(c.dtype);
  const double fwd_bytes = 4 * tensor_bytes, fwd_bwd_bytes = 12 * tensor_bytes;
  const double tokens = static_cast<double>(c.batch * c.tokens);
  return {{"op", c.op},
          {"backend", c.backend},
          {"device", device.str()},
          {"dtype", c10::toString(c.dtype)},
          {"B", c.batch},
          {"H", c.heads},
          {"N", c.tokens},
          {"D", c.head_dim},
          {"blocks", type.uses_blocks ? c.blocks : 1},
          {"causal", c.causal},
          {"deterministic", deterministic_sums()},
          {"fwd_ms", fwd_ms},
          {"fwd_bwd_ms", fwd_bwd_ms},
          {"tokens_per_s", tokens / (fwd_bwd_ms * 1e-3)},
          {"fwd_bytes", fwd_bytes},
          {"fwd_bwd_bytes", fwd_bwd_bytes},
          {"copy_bandwidth_gbs", copy_bandwidth / 1e9},
          {"fwd_bandwidth_share", fwd_bytes / (fwd_ms * 1e-3) / copy_bandwidth},
          {"fwd_bwd_bandwidth_share", fwd_bwd_bytes / (fwd_bwd_ms * 1e-3) / copy_bandwidth}};
}

}  // namespace mhla
