#pragma once
// What the plain-CUDA smoke drivers share: a CUDA-call check that exits with the failing line,
// and host vectors uploaded as an element type.
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <vector>

#define CHECK_CUDA(call)                                                                 \
  do {                                                                                   \
    cudaError_t err_ = (call);                                                           \
    if (err_ != cudaSuccess) {                                                           \
      std::fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(err_)); \
      std::exit(1);                                                                      \
    }                                                                                    \
  } while (0)

// A device copy of `host` converted to T (freed by the caller).
template <typename T>
T* upload(const std::vector<float>& host) {
  std::vector<T> converted(host.size());
  for (size_t i = 0; i < host.size(); ++i) converted[i] = T(host[i]);
  T* device = nullptr;
  CHECK_CUDA(cudaMalloc(&device, converted.size() * sizeof(T)));
  CHECK_CUDA(
      cudaMemcpy(device, converted.data(), converted.size() * sizeof(T), cudaMemcpyHostToDevice));
  return device;
}
