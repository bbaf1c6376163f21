#pragma once
// Programmatic dependent launch (sm_90): a kernel launched with launch() may be scheduled while
// the kernel before it on the stream is still finishing, and waits inside, in
// wait_for_previous_grid(), until that grid has completed and its writes are visible. What
// overlaps is the launch itself and the CTAs' start on multiprocessors the previous grid has
// left; the kernels' work does not. The bidirectional MHLA step runs six dependent kernels back
// to back (states, mix, output; query, mix backward, key), each a persistent grid whose last
// CTAs leave most multiprocessors idle at its end.
//
// A kernel launched this way must call wait_for_previous_grid() before its first global memory
// access, read or write: before the wait, the previous grid may still read memory this one would
// write (the caching allocator hands freed blocks to the next op on the stream). Called in a
// kernel launched the ordinary way, the wait returns at once. allow_next_grid() lets the
// kernel after this one be scheduled before this grid ends (else that happens as its CTAs exit).
// MHLA_DEPENDENT_LAUNCH=0 launches the ordinary way (A/B runs).
#include <cuda_runtime.h>

#include <cstdlib>
#include <cstring>
#include <utility>

namespace mhla_kernels {
namespace dependent_launch {

inline bool enabled() {
  static const bool on = [] {
    const char* value = std::getenv("MHLA_DEPENDENT_LAUNCH");
    return value == nullptr || std::strcmp(value, "0") != 0;
  }();
  return on;
}

template <typename... Params, typename... Args>
cudaError_t launch(void (*kernel)(Params...), dim3 grid, dim3 block, size_t shared_bytes,
                   cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = shared_bytes;
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = enabled() ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

__device__ __forceinline__ void wait_for_previous_grid() {
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
}

__device__ __forceinline__ void allow_next_grid() {
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
}

}  // namespace dependent_launch
}  // namespace mhla_kernels
