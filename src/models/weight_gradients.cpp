#include "models/weight_gradients.h"

#include "core/environment.h"
#include "core/error.h"
#include "models/linear.h"

#ifdef MHLA_WITH_CUDA_KERNELS
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "core/kernel_dtype.h"
#include "gemm_epilogue/weight_gradient.h"
#endif

namespace mhla {

std::pair<torch::Tensor, torch::Tensor> weight_gradients(const torch::Tensor& dy,
                                                         const torch::Tensor& x, bool with_bias) {
#ifdef MHLA_WITH_CUDA_KERNELS
  static const bool epilogue = environment_switch("MHLA_BGRAD_EPILOGUE", true);
  const auto dtype = kernel_dtype_of(dy.scalar_type());
  if (epilogue && dy.is_cuda() && dtype && dy.scalar_type() == x.scalar_type() &&
      dy.is_contiguous() && x.is_contiguous() &&
      mhla_kernels::weight_gradient_supported(*dtype, dy.size(0), x.size(1), dy.size(1))) {
    namespace kernels = mhla_kernels;
    const c10::cuda::CUDAGuard on_device(dy.device());
    auto f32 = dy.options().dtype(torch::kFloat32);
    auto dw = torch::empty({dy.size(1), x.size(1)}, f32);
    auto db = with_bias ? torch::empty({dy.size(1)}, f32) : torch::Tensor();
    auto workspace = torch::empty({static_cast<int64_t>(kernels::kEpilogueWorkspaceBytes)},
                                  dy.options().dtype(torch::kUInt8));
    kernels::EpilogueContext context;
    context.handle = at::cuda::getCurrentCUDABlasLtHandle();
    context.workspace = workspace.data_ptr();
    context.workspace_bytes = kernels::kEpilogueWorkspaceBytes;
    context.stream = c10::cuda::getCurrentCUDAStream(dy.device().index()).stream();
    kernels::WeightGradient a;
    a.dtype = *dtype;
    a.rows = dy.size(0), a.in_features = x.size(1), a.out_features = dy.size(1);
    a.grad_out = dy.data_ptr(), a.x = x.data_ptr();
    a.grad_weight = dw.data_ptr<float>();
    a.grad_bias = with_bias ? db.data_ptr<float>() : nullptr;
    if (const char* error = kernels::weight_gradient(a, context)) {
      fail("linear weight gradient ([{}, {}] x [{}, {}], cuBLASLt): {}", dy.size(0), dy.size(1),
           x.size(0), x.size(1), error);
    }
    return {dw, db};
  }
#endif
  const auto accumulate = x.scalar_type() == torch::kFloat64 ? torch::kFloat64 : torch::kFloat32;
  auto dw = dy.t().mm(x).to(accumulate);
  return {dw, with_bias ? column_sums(dy) : torch::Tensor()};
}

}  // namespace mhla
