#include "attention/kernel_views.h"

#ifdef MHLA_WITH_CUDA_KERNELS

#include "core/error.h"
#include "core/kernel_dtype.h"

namespace mhla {

namespace kernels = mhla_kernels;

kernels::DType kernel_dtype(torch::ScalarType type) {
  const auto dtype = kernel_dtype_of(type);
  if (!dtype) {
    fail("cuda attention: unsupported dtype {} (float32, float16, bfloat16)", c10::toString(type));
  }
  return *dtype;
}

// A [B, N, H, D] view the kernels can read in 16-byte vectors: last dimension contiguous, every
// row aligned. The q/k/v slices of the fused QKV projection qualify as they are.
torch::Tensor readable(const torch::Tensor& t, torch::ScalarType dtype) {
  auto x = t.scalar_type() == dtype ? t : t.to(dtype);
  const int64_t vector = 16 / static_cast<int64_t>(x.element_size());
  bool ok = x.stride(3) == 1 && reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0;
  for (int i = 0; i < 3; ++i) ok = ok && x.stride(i) % vector == 0;
  return ok ? x : x.contiguous();
}

kernels::TokenTensor view_of(const torch::Tensor& t) {
  return {t.data_ptr(), t.stride(0), t.stride(1), t.stride(2)};
}

void check_launch(cudaError_t err, const char* what) {
  if (err != cudaSuccess) fail("{}: CUDA error: {}", what, cudaGetErrorString(err));
}

void check_same_device(const std::string& op, const torch::Tensor& q,
                       std::initializer_list<std::pair<const char*, torch::Tensor>> others) {
  for (const auto& [name, t] : others) {
    if (t.defined() && t.device() != q.device()) {
      fail("{}: {} is on {} but q is on {}", op, name, t.device().str(), q.device().str());
    }
  }
}

// The kernels compute in v's dtype; q and k may arrive in another (autocast), and their
// gradients go back in the dtype they came in.
void remember_input_dtypes(torch::autograd::AutogradContext* ctx, const torch::Tensor& q,
                           const torch::Tensor& k) {
  ctx->saved_data["input_dtype_q"] = static_cast<int64_t>(q.scalar_type());
  ctx->saved_data["input_dtype_k"] = static_cast<int64_t>(k.scalar_type());
}

std::pair<torch::ScalarType, torch::ScalarType> input_dtypes(
    torch::autograd::AutogradContext* ctx) {
  return {static_cast<torch::ScalarType>(ctx->saved_data["input_dtype_q"].toInt()),
          static_cast<torch::ScalarType>(ctx->saved_data["input_dtype_k"].toInt())};
}

}  // namespace mhla

#endif  // MHLA_WITH_CUDA_KERNELS
