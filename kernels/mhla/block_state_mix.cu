// out[b, i] = sum_j w_ij in[b, j] over fp32 or bf16 block states (see block_state_mix.h).
#include <algorithm>

#include "common/packed_access.cuh"
#include "mhla/block_state_mix.h"
#include "mhla/state_storage.cuh"

namespace mhla_kernels {
namespace {

constexpr int kThreads = 128;
constexpr int kGroup = 16;  // output blocks accumulated at once (16 x 4 floats per thread)
constexpr int kBatch = 8;   // input blocks loaded at once

__host__ __device__ constexpr int padded(int blocks) {
  return (blocks + kGroup - 1) / kGroup * kGroup;
}

// Each thread owns four consecutive elements of every state (one 16-byte fp32 or 8-byte bf16
// word).
template <typename In, typename Out>
__global__ void __launch_bounds__(kThreads) state_mix_kernel(BlockStateMix p) {
  extern __shared__ float ws[];  // [padded][padded], zero outside the matrix
  const int np = padded(p.blocks);
  for (int e = threadIdx.x; e < np * np; e += kThreads) {
    const int i = e / np, j = e % np;
    ws[e] = i < p.blocks && j < p.blocks ? p.weights[i * p.blocks + j] : 0.f;
  }
  __syncthreads();
  const int64_t quads = p.elements / 4;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (c >= quads) return;
  const size_t base = static_cast<size_t>(blockIdx.y) * p.blocks * quads + c;
  const Pack<In, 4>* in = static_cast<const Pack<In, 4>*>(p.in) + base;
  Pack<Out, 4>* out = static_cast<Pack<Out, 4>*>(p.out) + base;
  for (int i0 = 0; i0 < p.blocks; i0 += kGroup) {
    float4 acc[kGroup];
#pragma unroll
    for (int r = 0; r < kGroup; ++r) acc[r] = make_float4(0.f, 0.f, 0.f, 0.f);
    const int j_begin = p.pattern == MixPattern::upper ? i0 : 0;
    const int j_end = p.pattern == MixPattern::lower ? min(p.blocks, i0 + kGroup) : p.blocks;
    for (int j0 = j_begin; j0 < j_end; j0 += kBatch) {
      float x[kBatch][4];
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        if (j0 + u < j_end) {
          load_pack<In, 4>(reinterpret_cast<const In*>(in + static_cast<size_t>(j0 + u) * quads),
                           x[u]);
        } else {
          x[u][0] = x[u][1] = x[u][2] = x[u][3] = 0.f;
        }
      }
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
#pragma unroll
        for (int r = 0; r < kGroup; ++r) {
          const float w = ws[(i0 + r) * np + j0 + u];  // j0 + u < np: j0 is a multiple of 8
          acc[r].x += w * x[u][0];
          acc[r].y += w * x[u][1];
          acc[r].z += w * x[u][2];
          acc[r].w += w * x[u][3];
        }
      }
    }
#pragma unroll
    for (int r = 0; r < kGroup; ++r) {
      if (i0 + r < p.blocks) {
        const float v[4] = {acc[r].x, acc[r].y, acc[r].z, acc[r].w};
        store_pack<Out, 4>(reinterpret_cast<Out*>(out + static_cast<size_t>(i0 + r) * quads), v);
      }
    }
  }
}

}  // namespace

cudaError_t block_state_mix(const BlockStateMix& p, cudaStream_t stream) {
  if (p.in == nullptr || p.weights == nullptr || p.out == nullptr || p.batch_heads <= 0 ||
      p.batch_heads > 65535 || p.blocks < 1 || p.blocks > kMaxMixBlocks || p.elements <= 0 ||
      p.elements % 4 != 0)
    return cudaErrorInvalidValue;
  return with_state_type(p.in_type, [&](auto in_tag) {
    return with_state_type(p.out_type, [&](auto out_tag) {
      using In = decltype(in_tag);
      using Out = decltype(out_tag);
      const size_t bytes = static_cast<size_t>(padded(p.blocks)) * padded(p.blocks) * sizeof(float);
      if (bytes > 48 * 1024) {
        const cudaError_t err = cudaFuncSetAttribute(state_mix_kernel<In, Out>,
                                                     cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                     static_cast<int>(bytes));
        if (err != cudaSuccess) return err;
      }
      const int64_t quads = p.elements / 4;
      const dim3 grid(static_cast<unsigned>((quads + kThreads - 1) / kThreads), p.batch_heads);
      state_mix_kernel<In, Out><<<grid, kThreads, bytes, stream>>>(p);
      return cudaGetLastError();
    });
  });
}

}  // namespace mhla_kernels
