#pragma once
// The CUDA stream the kernels launch on: PyTorch's current stream for a tensor's device, so our
// kernels order with ATen's work (CUDA builds only).
#ifdef MHLA_WITH_CUDA_KERNELS
#include <c10/cuda/CUDAStream.h>
#include <torch/torch.h>

namespace mhla {

inline cudaStream_t stream_of(const torch::Tensor& t) {
  return c10::cuda::getCurrentCUDAStream(t.device().index()).stream();
}

}  // namespace mhla
#endif
