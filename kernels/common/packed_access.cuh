#pragma once
// VEC consecutive elements moved as one access (16 bytes for 8 bf16 or 4 fp32): the vectorized
// loads and stores of the elementwise and row kernels, converted to and from fp32, and the warp
// sum their row reductions use. Callers check alignment and length before taking a VEC > 1 path.
#include "common/element_type.cuh"

namespace mhla_kernels {

template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Pack {
  T v[VEC];
};

template <typename T, int VEC>
__device__ __forceinline__ void load_pack(const T* p, float (&out)[VEC]) {
  const Pack<T, VEC> pack = *reinterpret_cast<const Pack<T, VEC>*>(p);
#pragma unroll
  for (int i = 0; i < VEC; ++i) out[i] = to_float(pack.v[i]);
}

template <typename T, int VEC>
__device__ __forceinline__ void store_pack(T* p, const float (&in)[VEC]) {
  Pack<T, VEC> pack;
#pragma unroll
  for (int i = 0; i < VEC; ++i) pack.v[i] = from_float<T>(in[i]);
  *reinterpret_cast<Pack<T, VEC>*>(p) = pack;
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

}  // namespace mhla_kernels
