#include "gated_delta/decode.h"

#include <cstdlib>
#include <type_traits>

#include "common/element_type.cuh"

namespace mhla_kernels {
namespace {

constexpr int kWarps = 16;  // key rows split over the warps
constexpr int kMaxKeyDim = 256;

template <int VEC>
struct alignas(4 * VEC) FloatPack {
  float v[VEC];
};

// grid (B * H, ceil(Dv / (32 VEC))), 16 warps: each lane owns VEC adjacent value columns, each
// warp ROWS key rows, so a thread holds ROWS x VEC state values in registers between the read
// (S~ = Diag(a) S and its k-product) and the write (S~ + k u^T and its q-product). VEC = 4
// moves the state in 16-byte accesses; many resident CTAs keep enough bytes in flight.
template <typename T, int VEC, int ROWS>
__global__ void __launch_bounds__(kWarps * 32) decode_kernel(DeltaDecodeArgs p) {
  constexpr int kColumns = 32 * VEC;
  __shared__ float k_s[kMaxKeyDim], q_s[kMaxKeyDim], a_s[kMaxKeyDim];
  __shared__ float partial[kWarps][kColumns];
  __shared__ float update[kColumns];
  const int bh = blockIdx.x, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int dk = p.key_dim, dv = p.value_dim;
  const int e0 = blockIdx.y * kColumns + lane * VEC;
  const bool column = e0 < dv;  // dv % VEC == 0: a lane's columns are all valid or none
  const T* q = static_cast<const T*>(p.q) + static_cast<int64_t>(bh) * dk;
  const T* k = static_cast<const T*>(p.k) + static_cast<int64_t>(bh) * dk;
  for (int d = threadIdx.x; d < dk; d += kWarps * 32) {
    k_s[d] = to_float(k[d]);
    q_s[d] = to_float(q[d]);
    a_s[d] = __expf(p.per_key_gate ? p.g[static_cast<int64_t>(bh) * dk + d] : p.g[bh]);
  }
  __syncthreads();

  float* state = p.state + static_cast<int64_t>(bh) * dk * dv;
  const int row0 = warp * ROWS;
  float s[ROWS][VEC];
  float u[VEC] = {};
#pragma unroll
  for (int i = 0; i < ROWS; ++i) {
    const int d = row0 + i;
    if (d < dk && column) {
      const auto pack =
          *reinterpret_cast<const FloatPack<VEC>*>(state + static_cast<int64_t>(d) * dv + e0);
#pragma unroll
      for (int j = 0; j < VEC; ++j) s[i][j] = pack.v[j];
    } else {
#pragma unroll
      for (int j = 0; j < VEC; ++j) s[i][j] = 0.f;
    }
  }
#pragma unroll
  for (int i = 0; i < ROWS; ++i) {
    const int d = min(row0 + i, dk - 1);
    const float a = row0 + i < dk ? a_s[d] : 0.f, kd = k_s[d];
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      s[i][j] *= a;  // S~ = Diag(a) S
      u[j] += s[i][j] * kd;
    }
  }
#pragma unroll
  for (int j = 0; j < VEC; ++j) partial[warp][lane * VEC + j] = u[j];
  __syncthreads();
  if (threadIdx.x < kColumns) {
    const int c = threadIdx.x, e = blockIdx.y * kColumns + c;
    float total = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) total += partial[w][c];
    const float ve =
        e < dv ? to_float(static_cast<const T*>(p.v)[static_cast<int64_t>(bh) * dv + e]) : 0.f;
    update[c] = p.beta[bh] * (ve - total);
  }
  __syncthreads();
  float ue[VEC], o[VEC] = {};
#pragma unroll
  for (int j = 0; j < VEC; ++j) ue[j] = update[lane * VEC + j];
#pragma unroll
  for (int i = 0; i < ROWS; ++i) {
    const int d = row0 + i;
    if (d < dk && column) {
      FloatPack<VEC> next;
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        next.v[j] = s[i][j] + k_s[d] * ue[j];
        o[j] += next.v[j] * q_s[d];
      }
      *reinterpret_cast<FloatPack<VEC>*>(state + static_cast<int64_t>(d) * dv + e0) = next;
    }
  }
  __syncthreads();  // every thread has read partial[][] above
#pragma unroll
  for (int j = 0; j < VEC; ++j) partial[warp][lane * VEC + j] = o[j];
  __syncthreads();
  if (threadIdx.x < kColumns) {
    const int c = threadIdx.x, e = blockIdx.y * kColumns + c;
    if (e < dv) {
      float total = 0.f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) total += partial[w][c];
      static_cast<T*>(p.out)[static_cast<int64_t>(bh) * dv + e] = from_float<T>(p.scale * total);
    }
  }
}

template <typename T, int VEC, int ROWS>
cudaError_t launch(const DeltaDecodeArgs& a, cudaStream_t stream) {
  constexpr int kColumns = 32 * VEC;
  const dim3 grid(a.batch * a.heads, (a.value_dim + kColumns - 1) / kColumns);
  decode_kernel<T, VEC, ROWS><<<grid, kWarps * 32, 0, stream>>>(a);
  return cudaGetLastError();
}

template <typename T, int VEC>
cudaError_t launch_rows(const DeltaDecodeArgs& a, cudaStream_t stream) {
  const int rows = (a.key_dim + kWarps - 1) / kWarps;
  if (rows <= 2) return launch<T, VEC, 2>(a, stream);
  if (rows <= 4) return launch<T, VEC, 4>(a, stream);
  if (rows <= 8) return launch<T, VEC, 8>(a, stream);
  return launch<T, VEC, 16>(a, stream);
}

// 16-byte state accesses where every row of the state stays aligned; MHLA_DECODE_VEC (1, 2 or
// 4) overrides the choice for tuning runs.
int vector_width(const DeltaDecodeArgs& a) {
  static const int forced = [] {
    const char* v = std::getenv("MHLA_DECODE_VEC");
    return v ? std::atoi(v) : 0;
  }();
  const bool aligned4 = a.value_dim % 4 == 0 && reinterpret_cast<uintptr_t>(a.state) % 16 == 0;
  const bool aligned2 = a.value_dim % 2 == 0 && reinterpret_cast<uintptr_t>(a.state) % 8 == 0;
  if (forced == 4 && aligned4) return 4;
  if (forced == 2 && aligned2) return 2;
  if (forced == 1) return 1;
  return aligned4 ? 4 : aligned2 ? 2 : 1;
}

}  // namespace

cudaError_t delta_rule_decode(const DeltaDecodeArgs& args, cudaStream_t stream) {
  if (args.batch <= 0 || args.heads <= 0 || args.key_dim <= 0 || args.key_dim > kMaxKeyDim ||
      args.value_dim <= 0 || static_cast<int64_t>(args.batch) * args.heads > 0x7fffffff ||
      (args.value_dim + 31) / 32 > 65535 || !args.q || !args.k || !args.v || !args.beta ||
      !args.g || !args.state || !args.out) {
    return cudaErrorInvalidValue;
  }
  const int vec = vector_width(args);
  return with_element_type(args.dtype, [&](auto tag) {
    using T = decltype(tag);
    if (vec == 4) return launch_rows<T, 4>(args, stream);
    if (vec == 2) return launch_rows<T, 2>(args, stream);
    return launch_rows<T, 1>(args, stream);
  });
}

}  // namespace mhla_kernels
