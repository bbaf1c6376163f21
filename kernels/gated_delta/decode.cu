#include "gated_delta/decode.h"

#include "common/element_type.cuh"

namespace mhla_kernels {
namespace {

constexpr int kColumns = 32;                    // value columns per CTA (one per lane)
constexpr int kWarps = 8;                       // key rows split over the warps
constexpr int kMaxKeyDim = 256;
constexpr int kRowsPerWarp = kMaxKeyDim / kWarps;

__device__ __forceinline__ float load(const float* p, int64_t i) { return p[i]; }
__device__ __forceinline__ float load(const __half* p, int64_t i) { return __half2float(p[i]); }
__device__ __forceinline__ float load(const __nv_bfloat16* p, int64_t i) {
  return __bfloat162float(p[i]);
}
__device__ __forceinline__ void store(float* p, int64_t i, float x) { p[i] = x; }
__device__ __forceinline__ void store(__half* p, int64_t i, float x) { p[i] = __float2half_rn(x); }
__device__ __forceinline__ void store(__nv_bfloat16* p, int64_t i, float x) {
  p[i] = __float2bfloat16_rn(x);
}

// grid (B * H, ceil(Dv / 32)), 256 threads: lane = value column, warp = a range of key rows.
template <typename T>
__global__ void __launch_bounds__(kWarps * 32) decode_kernel(DeltaDecodeArgs p) {
  __shared__ float k_s[kMaxKeyDim], q_s[kMaxKeyDim], a_s[kMaxKeyDim];
  __shared__ float partial[kWarps][kColumns];
  __shared__ float update[kColumns];
  const int bh = blockIdx.x, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int dk = p.key_dim, dv = p.value_dim;
  const int e = blockIdx.y * kColumns + lane;
  const bool column = e < dv;
  const T* q = static_cast<const T*>(p.q) + static_cast<int64_t>(bh) * dk;
  const T* k = static_cast<const T*>(p.k) + static_cast<int64_t>(bh) * dk;
  for (int d = threadIdx.x; d < dk; d += kWarps * 32) {
    k_s[d] = load(k, d);
    q_s[d] = load(q, d);
    a_s[d] = __expf(p.per_key_gate ? p.g[static_cast<int64_t>(bh) * dk + d] : p.g[bh]);
  }
  __syncthreads();

  float* state = p.state + static_cast<int64_t>(bh) * dk * dv;
  const int rows = (dk + kWarps - 1) / kWarps, row0 = warp * rows;
  float s[kRowsPerWarp];
  float u = 0.f;
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    const int d = row0 + i;
    s[i] = 0.f;
    if (i < rows && d < dk && column) {
      s[i] = a_s[d] * state[static_cast<int64_t>(d) * dv + e];  // S~ = Diag(a) S
      u += s[i] * k_s[d];
    }
  }
  partial[warp][lane] = u;
  __syncthreads();
  if (warp == 0) {
    float total = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) total += partial[w][lane];
    const float ve = column ? load(static_cast<const T*>(p.v), static_cast<int64_t>(bh) * dv + e) : 0.f;
    update[lane] = p.beta[bh] * (ve - total);
  }
  __syncthreads();
  const float ue = update[lane];
  float o = 0.f;
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    const int d = row0 + i;
    if (i < rows && d < dk && column) {
      const float next = s[i] + k_s[d] * ue;
      state[static_cast<int64_t>(d) * dv + e] = next;
      o += next * q_s[d];
    }
  }
  __syncthreads();  // every warp has read partial[][] above
  partial[warp][lane] = o;
  __syncthreads();
  if (warp == 0 && column) {
    float total = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) total += partial[w][lane];
    store(static_cast<T*>(p.out), static_cast<int64_t>(bh) * dv + e, p.scale * total);
  }
}

template <typename T>
cudaError_t launch(const DeltaDecodeArgs& a, cudaStream_t stream) {
  const dim3 grid(a.batch * a.heads, (a.value_dim + kColumns - 1) / kColumns);
  decode_kernel<T><<<grid, kWarps * 32, 0, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace

cudaError_t delta_rule_decode(const DeltaDecodeArgs& args, cudaStream_t stream) {
  if (args.batch <= 0 || args.heads <= 0 || args.key_dim <= 0 || args.key_dim > kMaxKeyDim ||
      args.value_dim <= 0 || static_cast<int64_t>(args.batch) * args.heads > 0x7fffffff ||
      (args.value_dim + kColumns - 1) / kColumns > 65535 || !args.q || !args.k || !args.v ||
      !args.beta || !args.g || !args.state || !args.out) {
    return cudaErrorInvalidValue;
  }
  return with_element_type(args.dtype, [&](auto tag) {
    using T = decltype(tag);
    return launch<T>(args, stream);
  });
}

}  // namespace mhla_kernels
