// See pack_state_set.h. One CTA per state (a grid-stride loop past 65,535): each thread rounds
// float4 groups of S to four bf16 and copies part of z.
#include <cuda_bf16.h>

#include "mhla/pack_state_set.h"

namespace mhla_kernels {
namespace {

constexpr int kPackThreads = 256;

template <int D>
__global__ void __launch_bounds__(kPackThreads)
    pack_state_set_kernel(const float* set, float* packed, int64_t states) {
  constexpr int kGroups = D * D / 4;                        // float4 groups of S
  constexpr int64_t kIn = D * D + D, kOut = D * D / 2 + D;  // floats per state
  for (int64_t state = blockIdx.x; state < states; state += gridDim.x) {
    const float4* src = reinterpret_cast<const float4*>(set + state * kIn);
    uint2* dst = reinterpret_cast<uint2*>(packed + state * kOut);
    for (int g = static_cast<int>(threadIdx.x); g < kGroups; g += kPackThreads) {
      const float4 x = src[g];
      const __nv_bfloat162 low = __floats2bfloat162_rn(x.x, x.y);
      const __nv_bfloat162 high = __floats2bfloat162_rn(x.z, x.w);
      dst[g] = make_uint2(*reinterpret_cast<const unsigned*>(&low),
                          *reinterpret_cast<const unsigned*>(&high));
    }
    for (int e = static_cast<int>(threadIdx.x); e < D; e += kPackThreads)
      packed[state * kOut + D * D / 2 + e] = set[state * kIn + D * D + e];
  }
}

}  // namespace

cudaError_t pack_state_set(const float* set, float* packed, int64_t states, int head_dim,
                           cudaStream_t stream) {
  if (states < 1 || set == nullptr || packed == nullptr ||
      reinterpret_cast<uintptr_t>(set) % 16 != 0 || reinterpret_cast<uintptr_t>(packed) % 16 != 0)
    return cudaErrorInvalidValue;
  const int grid = static_cast<int>(states < 65535 ? states : 65535);
  switch (head_dim) {
    case 32:
      pack_state_set_kernel<32><<<grid, kPackThreads, 0, stream>>>(set, packed, states);
      break;
    case 64:
      pack_state_set_kernel<64><<<grid, kPackThreads, 0, stream>>>(set, packed, states);
      break;
    case 128:
      pack_state_set_kernel<128><<<grid, kPackThreads, 0, stream>>>(set, packed, states);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace mhla_kernels
