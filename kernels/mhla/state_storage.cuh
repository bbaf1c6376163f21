#pragma once
// Device side of state_type.h: the element type of a StateType, a launcher dispatch over it, and
// the per-thread packs of the state sweeps (4 bytes a thread: one fp32 element or two bf16).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "common/packed_access.cuh"
#include "mhla/state_type.h"

namespace mhla_kernels {

// Calls f(S{}) with S the stored element type (float or __nv_bfloat16).
template <typename F>
cudaError_t with_state_type(StateType type, F&& f) {
  switch (type) {
    case StateType::f32:
      return f(float{});
    case StateType::bf16:
      return f(__nv_bfloat16{});
  }
  return cudaErrorInvalidValue;
}

// Elements of a state set one sweep thread owns: a 4-byte word, so that a warp's access stays
// 128 bytes whatever the storage (a bf16 sweep with one element a thread would halve the bytes in
// flight of these latency-bound passes).
template <typename S>
constexpr int kSweepLanes = 4 / static_cast<int>(sizeof(S));

}  // namespace mhla_kernels
