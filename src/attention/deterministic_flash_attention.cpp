#include "attention/deterministic_flash_attention.h"

#include <ATen/Context.h>
#include <ATen/ops/_scaled_dot_product_flash_attention.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_backward.h>

#include "core/determinism.h"

namespace mhla {
namespace {

// ATen's deterministic-algorithms flag on (not warn-only) for one scope, then as it was.
class DeterministicAlgorithmsScope {
 public:
  DeterministicAlgorithmsScope()
      : before_(at::globalContext().deterministicAlgorithms()),
        warn_only_before_(at::globalContext().deterministicAlgorithmsWarnOnly()) {
    at::globalContext().setDeterministicAlgorithms(true, false);
  }
  ~DeterministicAlgorithmsScope() {
    at::globalContext().setDeterministicAlgorithms(before_, warn_only_before_);
  }
  DeterministicAlgorithmsScope(const DeterministicAlgorithmsScope&) = delete;
  DeterministicAlgorithmsScope& operator=(const DeterministicAlgorithmsScope&) = delete;

 private:
  bool before_, warn_only_before_;
};

class DeterministicFlashFunction : public torch::autograd::Function<DeterministicFlashFunction> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& q,
                               const torch::Tensor& k, const torch::Tensor& v, bool causal) {
    // The forward has no cross-CTA sums: the same bits on every run already.
    auto [out, logsumexp, cum_q, cum_k, max_q, max_k, seed, offset, unused] =
        at::_scaled_dot_product_flash_attention(q, k, v, /*dropout_p=*/0.0, causal);
    ctx->save_for_backward({q, k, v, out, logsumexp, cum_q, cum_k, seed, offset});
    ctx->saved_data["max_q"] = max_q.expect_int();
    ctx->saved_data["max_k"] = max_k.expect_int();
    ctx->saved_data["causal"] = causal;
    return out;
  }

  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    const auto s = ctx->get_saved_variables();
    DeterministicAlgorithmsScope ordered;  // FlashAttention's ordered dq accumulation
    auto [dq, dk, dv] = at::_scaled_dot_product_flash_attention_backward(
        grads[0].contiguous(), s[0], s[1], s[2], s[3], s[4], s[5], s[6],
        ctx->saved_data["max_q"].toInt(), ctx->saved_data["max_k"].toInt(), /*dropout_p=*/0.0,
        ctx->saved_data["causal"].toBool(), s[7], s[8]);
    return {dq, dk, dv, torch::Tensor()};
  }
};

}  // namespace

bool deterministic_flash_takes(const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v) {
  const auto type = q.scalar_type();
  const int64_t d = q.size(-1);
  return deterministic_sums() && q.is_cuda() &&
         (type == torch::kBFloat16 || type == torch::kFloat16) && k.scalar_type() == type &&
         v.scalar_type() == type && d % 8 == 0 && d <= 256 && k.size(-1) == d && v.size(-1) == d;
}

torch::Tensor deterministic_flash_attention(const torch::Tensor& q, const torch::Tensor& k,
                                            const torch::Tensor& v, bool causal) {
  return DeterministicFlashFunction::apply(q, k, v, causal);
}

}  // namespace mhla
