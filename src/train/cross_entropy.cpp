#include "train/cross_entropy.h"

#include <limits>

#include "core/environment.h"
#include "core/error.h"

#ifdef MHLA_WITH_CUDA_KERNELS
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "core/kernel_dtype.h"
#include "cross_entropy/cross_entropy.h"
#endif

namespace mhla {
namespace {

void check_shapes(const torch::Tensor& logits, const torch::Tensor& targets) {
  if (logits.dim() < 1 || logits.size(-1) < 1) {
    fail("cross-entropy: logits [..., classes] with at least one class, got {}",
         c10::str(logits.sizes()));
  }
  if (targets.numel() * logits.size(-1) != logits.numel()) {
    fail("cross-entropy: {} targets for logits {}", targets.numel(), c10::str(logits.sizes()));
  }
}

torch::Tensor torch_rows(const torch::Tensor& logits, const torch::Tensor& targets,
                         double label_smoothing) {
  const auto type = logits.scalar_type() == torch::kFloat64 ? torch::kFloat64 : torch::kFloat32;
  namespace F = torch::nn::functional;
  return F::cross_entropy(
      logits.reshape({-1, logits.size(-1)}).to(type), targets.reshape({-1}),
      F::CrossEntropyFuncOptions().reduction(torch::kNone).label_smoothing(label_smoothing));
}

#ifdef MHLA_WITH_CUDA_KERNELS

namespace kernels = mhla_kernels;

kernels::CrossEntropyArgs kernel_args(const torch::Tensor& logits, const torch::Tensor& targets,
                                      double label_smoothing) {
  kernels::CrossEntropyArgs a;
  a.dtype = *kernel_dtype_of(logits.scalar_type());
  a.rows = logits.size(0);
  a.classes = static_cast<int>(logits.size(1));
  a.logits = logits.data_ptr();
  a.row_stride = logits.stride(0);
  a.targets = targets.data_ptr<int64_t>();
  a.label_smoothing = static_cast<float>(label_smoothing);
  return a;
}

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) fail("cross-entropy (cuda) {}: {}", what, cudaGetErrorString(err));
}

// Saves the logits (not a copy) and the rows' log-sum-exp; the backward rereads the logits.
class CrossEntropyFunction : public torch::autograd::Function<CrossEntropyFunction> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& logits,
                               const torch::Tensor& targets, double label_smoothing) {
    c10::cuda::CUDAGuard on_device(logits.device());
    auto f32 = logits.options().dtype(torch::kFloat32);
    auto loss = torch::empty({logits.size(0)}, f32);
    auto lse = torch::empty({logits.size(0)}, f32);
    auto a = kernel_args(logits, targets, label_smoothing);
    a.loss = loss.data_ptr<float>();
    a.lse = lse.data_ptr<float>();
    check(kernels::cross_entropy_forward(
              a, c10::cuda::getCurrentCUDAStream(logits.device().index()).stream()),
          "forward");
    ctx->save_for_backward({logits, targets, lse});
    ctx->saved_data["label_smoothing"] = label_smoothing;
    ctx->mark_non_differentiable({lse});
    return loss;
  }

  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto& logits = saved[0];
    const auto& targets = saved[1];
    auto lse = saved[2];
    c10::cuda::CUDAGuard on_device(logits.device());
    auto grad_loss = grads[0].to(torch::kFloat32).contiguous();
    auto grad_logits = torch::empty(
        logits.sizes(), logits.options().memory_format(torch::MemoryFormat::Contiguous));
    auto a = kernel_args(logits, targets, ctx->saved_data["label_smoothing"].toDouble());
    a.lse = lse.data_ptr<float>();
    a.grad_loss = grad_loss.data_ptr<float>();
    a.grad_logits = grad_logits.data_ptr();
    check(kernels::cross_entropy_backward(
              a, c10::cuda::getCurrentCUDAStream(logits.device().index()).stream()),
          "backward");
    return {grad_logits, torch::Tensor(), torch::Tensor()};
  }
};

#endif

}  // namespace

bool cross_entropy_uses_kernel(const torch::Tensor& logits) {
#ifdef MHLA_WITH_CUDA_KERNELS
  static const bool enabled = environment_switch("MHLA_FUSED_CE", true);
  return enabled && logits.is_cuda() && kernel_dtype_of(logits.scalar_type()).has_value() &&
         logits.size(-1) <= std::numeric_limits<int>::max();
#else
  (void)logits;
  return false;
#endif
}

torch::Tensor cross_entropy_rows_kernel(const torch::Tensor& logits, const torch::Tensor& targets,
                                        double label_smoothing) {
  check_shapes(logits, targets);
  if (label_smoothing < 0.0 || label_smoothing > 1.0) {
    fail("cross-entropy: label smoothing {} is outside [0, 1]", label_smoothing);
  }
#ifdef MHLA_WITH_CUDA_KERNELS
  if (!logits.is_cuda() || !kernel_dtype_of(logits.scalar_type())) {
    fail("cross-entropy kernel: needs fp32/bf16/fp16 logits on CUDA, got {} on {}",
         c10::toString(logits.scalar_type()), logits.device().str());
  }
  auto rows = logits.reshape({-1, logits.size(-1)});
  if (rows.stride(1) != 1) rows = rows.contiguous();
  auto t = targets.reshape({-1}).to(torch::kInt64).contiguous();
  return CrossEntropyFunction::apply(rows, t, label_smoothing);
#else
  fail("cross-entropy kernel: this build has no CUDA kernels");
#endif
}

torch::Tensor mean_cross_entropy(const torch::Tensor& logits, const torch::Tensor& targets,
                                 double label_smoothing) {
  check_shapes(logits, targets);
  if (cross_entropy_uses_kernel(logits)) {
    return cross_entropy_rows_kernel(logits, targets, label_smoothing).mean();
  }
  return torch_rows(logits, targets, label_smoothing).mean();
}

torch::Tensor summed_cross_entropy(const torch::Tensor& logits, const torch::Tensor& targets,
                                   double label_smoothing) {
  check_shapes(logits, targets);
  if (cross_entropy_uses_kernel(logits)) {
    return cross_entropy_rows_kernel(logits, targets, label_smoothing).sum();
  }
  return torch_rows(logits, targets, label_smoothing).sum();
}

}  // namespace mhla
