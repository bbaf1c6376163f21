#pragma once
// Facts about the current CUDA device that the launchers size persistent grids by.
#include <cuda_runtime.h>

namespace mhla_kernels {

// Multiprocessors of the current device, read once (the machines run one kind of GPU).
inline int multiprocessors() {
  static const int count = [] {
    int device = 0, value = 0;
    cudaGetDevice(&device);
    cudaDeviceGetAttribute(&value, cudaDevAttrMultiProcessorCount, device);
    return value > 0 ? value : 1;
  }();
  return count;
}

}  // namespace mhla_kernels
