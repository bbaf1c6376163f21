// out[b, i] = sum_j w_ij in[b, j] over fp32 block states (see block_state_mix.h).
#include <algorithm>
#include <cstdlib>
#include <string>

#include <cuda_bf16.h>

#include "common/device_info.h"
#include "mhla/block_state_mix.h"
#include "mhla/packed_mix.cuh"

namespace mhla_kernels {
namespace {

constexpr int kThreads = 128;
constexpr int kMaxGroup = 16;  // the weights' shared tile is padded to multiples of this

__host__ __device__ constexpr int padded(int blocks) {
  return (blocks + kMaxGroup - 1) / kMaxGroup * kMaxGroup;
}

// The weights into the CTA's shared tile, padded to np x np with zeros, then a barrier; returns
// np. Both kernels below start with it.
__device__ __forceinline__ int load_weights(const BlockStateMix& p, float* ws) {
  const int np = padded(p.blocks);
  for (int e = threadIdx.x; e < np * np; e += kThreads) {
    const int i = e / np, j = e % np;
    ws[e] = i < p.blocks && j < p.blocks ? p.weights[i * p.blocks + j] : 0.f;
  }
  __syncthreads();
  return np;
}

// Group: output blocks accumulated at once (Group float4 per thread); Batch: input blocks loaded
// at once; MinCtas: CTAs per multiprocessor the registers are capped for. The default (8, 8) at
// 126 registers runs four CTAs per SM and reads its inputs twice for 16 blocks, the second time
// from L2: 54 against 66 us at B = 64, N = 1,024, H = 6, D = 64, M = 16 for (16, 8) at its
// natural 193 registers, two CTAs (session 25, calls 9-10). MHLA_STATE_MIX selects others for A/B
// runs: "group16" (16, 8) at two CTAs, "group8x5" (8, 8) at five. Group must be a multiple of
// Batch: j0 + u then stays inside the padded weights' row (the upper pattern starts j at i0).
template <int MinCtas, int Group, int Batch>
__global__ void __launch_bounds__(kThreads, MinCtas) state_mix_kernel(BlockStateMix p) {
  static_assert(kMaxGroup % Group == 0 && Group % Batch == 0, "weights tile padding");
  extern __shared__ float ws[];  // [padded][padded], zero outside the matrix
  const int np = load_weights(p, ws);
  const int64_t quads = p.elements / 4;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (c >= quads) return;
  const size_t base = static_cast<size_t>(blockIdx.y) * p.blocks * quads + c;
  const float4* in = reinterpret_cast<const float4*>(p.in) + base;
  float4* out = reinterpret_cast<float4*>(p.out) + base;
  // A packed row: element 4c of the matrix part as four bf16 (8 bytes), of the rest as a float4.
  const int64_t e = 4 * c, matrix = p.packed_matrix;
  const int64_t packed_row = matrix / 2 + p.elements - matrix;
  auto store = [&](int i, float4 v) {
    if (matrix == 0) {
      out[static_cast<size_t>(i) * quads] = v;
      return;
    }
    float* row = p.out + (static_cast<size_t>(blockIdx.y) * p.blocks + i) * packed_row;
    if (e < matrix) {
      __nv_bfloat162 pair[2] = {__floats2bfloat162_rn(v.x, v.y), __floats2bfloat162_rn(v.z, v.w)};
      *reinterpret_cast<uint2*>(reinterpret_cast<__nv_bfloat16*>(row) + e) =
          *reinterpret_cast<const uint2*>(pair);
    } else {
      *reinterpret_cast<float4*>(row + matrix / 2 + e - matrix) = v;
    }
  };
  for (int i0 = 0; i0 < p.blocks; i0 += Group) {
    float4 acc[Group];
#pragma unroll
    for (int r = 0; r < Group; ++r) acc[r] = make_float4(0.f, 0.f, 0.f, 0.f);
    const int j_begin = p.pattern == MixPattern::upper ? i0 : 0;
    const int j_end = p.pattern == MixPattern::lower ? min(p.blocks, i0 + Group) : p.blocks;
    for (int j0 = j_begin; j0 < j_end; j0 += Batch) {
      float4 x[Batch];
#pragma unroll
      for (int u = 0; u < Batch; ++u) {
        x[u] = j0 + u < j_end ? __ldg(in + static_cast<size_t>(j0 + u) * quads)
                              : make_float4(0.f, 0.f, 0.f, 0.f);
      }
#pragma unroll
      for (int u = 0; u < Batch; ++u) {
#pragma unroll
        for (int r = 0; r < Group; ++r) {
          const float w = ws[(i0 + r) * np + j0 + u];  // j0 + u < np: j0 is a multiple of 8
          acc[r].x += w * x[u].x;
          acc[r].y += w * x[u].y;
          acc[r].z += w * x[u].z;
          acc[r].w += w * x[u].w;
        }
      }
    }
#pragma unroll
    for (int r = 0; r < Group; ++r) {
      if (i0 + r < p.blocks) store(i0 + r, acc[r]);
    }
  }
}

// Eight bf16 of a packed matrix part (one 16-byte load) and the fp32 rest as four floats.
struct Bf16Octet {
  using Raw = uint4;
  static constexpr int n = 8;
  __device__ static void fma(float (&acc)[8], float w, const uint4& x) {
    const unsigned words[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {  // bf16 -> fp32 is a shift: low half, then high half
      acc[2 * k] = fmaf(w, __uint_as_float(words[k] << 16), acc[2 * k]);
      acc[2 * k + 1] = fmaf(w, __uint_as_float(words[k] & 0xffff0000u), acc[2 * k + 1]);
    }
  }
  __device__ static uint4 pack(const float (&acc)[8]) {
    uint4 out;
    unsigned* words = reinterpret_cast<unsigned*>(&out);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const __nv_bfloat162 pair = __floats2bfloat162_rn(acc[2 * k], acc[2 * k + 1]);
      words[k] = *reinterpret_cast<const unsigned*>(&pair);
    }
    return out;
  }
};
struct Fp32Quad {
  using Raw = float4;
  static constexpr int n = 4;
  __device__ static void fma(float (&acc)[4], float w, const float4& x) {
    acc[0] = fmaf(w, x.x, acc[0]);
    acc[1] = fmaf(w, x.y, acc[1]);
    acc[2] = fmaf(w, x.z, acc[2]);
    acc[3] = fmaf(w, x.w, acc[3]);
  }
  __device__ static float4 pack(const float (&acc)[4]) {
    return make_float4(acc[0], acc[1], acc[2], acc[3]);
  }
};

// out[i] = sum_j w_ij in[j] for one thread's column of V::n elements, state rows `stride` Raw
// apart (the loops of state_mix_kernel).
template <class V, int Group, int Batch>
__device__ __forceinline__ void mix_column(const BlockStateMix& p, const float* ws, int np,
                                           const typename V::Raw* in, typename V::Raw* out,
                                           size_t stride) {
  using Raw = typename V::Raw;
  for (int i0 = 0; i0 < p.blocks; i0 += Group) {
    float acc[Group][V::n];
#pragma unroll
    for (int r = 0; r < Group; ++r) {
#pragma unroll
      for (int k = 0; k < V::n; ++k) acc[r][k] = 0.f;
    }
    const int j_begin = p.pattern == MixPattern::upper ? i0 : 0;
    const int j_end = p.pattern == MixPattern::lower ? min(p.blocks, i0 + Group) : p.blocks;
    for (int j0 = j_begin; j0 < j_end; j0 += Batch) {
      Raw x[Batch];
#pragma unroll
      for (int u = 0; u < Batch; ++u) {
        x[u] = j0 + u < j_end ? __ldg(in + static_cast<size_t>(j0 + u) * stride) : Raw{};
      }
#pragma unroll
      for (int u = 0; u < Batch; ++u) {
#pragma unroll
        for (int r = 0; r < Group; ++r) V::fma(acc[r], ws[(i0 + r) * np + j0 + u], x[u]);
      }
    }
#pragma unroll
    for (int r = 0; r < Group; ++r) {
      if (i0 + r < p.blocks) out[static_cast<size_t>(i0 + r) * stride] = V::pack(acc[r]);
    }
  }
}

// Packed sets in and out (the bidirectional MHLA binding's S, one chunk per block) where the
// tensor-core kernel (packed_mix.cuh) does not take them (more than 16 blocks, a triangular
// pattern) or MHLA_PACKED_STATE_MIX=simt asks for this one (A/B runs): the bf16
// matrix part read and written eight elements (16 bytes) per thread, half the bytes of the fp32
// states; the fp32 rest (z) four per thread, in the CTAs after the matrix part's. Session 25
// read packed states with 8-byte loads in state_mix_kernel and was slower than fp32 (91.7
// against 61.1 us at N = 1,024): half the bytes in flight per load.
template <int MinCtas, int Group, int Batch>
__global__ void __launch_bounds__(kThreads, MinCtas) packed_state_mix_kernel(BlockStateMix p) {
  extern __shared__ float ws[];  // [padded][padded], zero outside the matrix
  const int np = load_weights(p, ws);
  const int64_t matrix = p.packed_matrix;
  const int64_t row_floats = matrix / 2 + p.elements - matrix;  // a multiple of 4
  const size_t base = static_cast<size_t>(blockIdx.y) * p.blocks * row_floats;
  const int64_t octets = matrix / 8;
  const int matrix_ctas = static_cast<int>((octets + kThreads - 1) / kThreads);
  if (static_cast<int>(blockIdx.x) < matrix_ctas) {
    const int64_t c = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
    if (c >= octets) return;
    mix_column<Bf16Octet, Group, Batch>(p, ws, np, reinterpret_cast<const uint4*>(p.in + base) + c,
                                        reinterpret_cast<uint4*>(p.out + base) + c, row_floats / 4);
  } else {
    const int64_t c = static_cast<int64_t>(blockIdx.x - matrix_ctas) * kThreads + threadIdx.x;
    if (c >= (p.elements - matrix) / 4) return;
    const size_t rest = base + matrix / 2;
    mix_column<Fp32Quad, Group, Batch>(p, ws, np, reinterpret_cast<const float4*>(p.in + rest) + c,
                                       reinterpret_cast<float4*>(p.out + rest) + c, row_floats / 4);
  }
}

}  // namespace

cudaError_t block_state_mix(const BlockStateMix& p, cudaStream_t stream) {
  if (p.in == nullptr || p.weights == nullptr || p.out == nullptr || p.batch_heads <= 0 ||
      p.batch_heads > 65535 || p.blocks < 1 || p.blocks > kMaxMixBlocks || p.elements <= 0 ||
      p.elements % 4 != 0 || p.packed_matrix < 0 || p.packed_matrix % 8 != 0 ||
      p.packed_matrix > p.elements || (p.packed_in && p.packed_matrix == 0))
    return cudaErrorInvalidValue;
  const size_t bytes = static_cast<size_t>(padded(p.blocks)) * padded(p.blocks) * sizeof(float);
  static const bool simt_packed = [] {
    const char* value = std::getenv("MHLA_PACKED_STATE_MIX");
    return value != nullptr && std::string(value) == "simt";
  }();
  if (p.packed_in && p.pattern == MixPattern::dense && !simt_packed &&
      packed_mix::takes(p.blocks, p.packed_matrix, p.elements)) {
    packed_mix::PackedMix args;  // tensor cores (packed_mix.cuh)
    args.in = p.in, args.mixing = p.weights, args.out = p.out;
    args.batch_heads = p.batch_heads, args.blocks = p.blocks;
    args.elements = p.elements, args.matrix = p.packed_matrix;
    return packed_mix::launch<false>(args, multiprocessors(), stream);
  }
  if (p.packed_in) {
    constexpr auto packed_kernel = packed_state_mix_kernel<4, 8, 8>;
    if (bytes > 48 * 1024) {
      const cudaError_t err = cudaFuncSetAttribute(
          packed_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
      if (err != cudaSuccess) return err;
    }
    const int64_t matrix_ctas = (p.packed_matrix / 8 + kThreads - 1) / kThreads;
    const int64_t rest_ctas = ((p.elements - p.packed_matrix) / 4 + kThreads - 1) / kThreads;
    const dim3 grid(static_cast<unsigned>(matrix_ctas + rest_ctas), p.batch_heads);
    packed_kernel<<<grid, kThreads, bytes, stream>>>(p);
    return cudaGetLastError();
  }
  static const auto kernel = [] {
    const char* value = std::getenv("MHLA_STATE_MIX");
    const std::string variant = value != nullptr ? value : "";
    if (variant == "group16") return state_mix_kernel<1, 16, 8>;
    if (variant == "group8x5") return state_mix_kernel<5, 8, 8>;
    return state_mix_kernel<4, 8, 8>;
  }();
  if (bytes > 48 * 1024) {
    const cudaError_t err = cudaFuncSetAttribute(
        kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
    if (err != cudaSuccess) return err;
  }
  const int64_t quads = p.elements / 4;
  const dim3 grid(static_cast<unsigned>((quads + kThreads - 1) / kThreads), p.batch_heads);
  kernel<<<grid, kThreads, bytes, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace mhla_kernels
