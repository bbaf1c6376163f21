#include "gated_delta/chunk_recurrence.h"

namespace mhla_kernels {
namespace {

constexpr int kColumns = 32;  // value columns per CTA: one per lane
constexpr int kWarps = 8;
constexpr int kRowsPerWarp = kDeltaChunkMaxChunk / kWarps;           // step 1: chunk rows
constexpr int kGroupsPerWarp = kDeltaChunkMaxKeyDim / (4 * kWarps);  // step 2: 4-key groups

size_t shared_bytes(const DeltaChunkArgs& a) {
  // S [Dk][32], the two chunk tiles [C][Dk], X [C][32].
  return sizeof(float) *
         (static_cast<size_t>(a.key_dim) * kColumns + 2 * static_cast<size_t>(a.chunk) * a.key_dim +
          static_cast<size_t>(a.chunk) * kColumns);
}

// Step 1, X[c][j] (+/-)= sum_k M1[c][k] S[k][j]: a thread takes rows c = warp + 8m of its lane's
// column, reads M1 as float4 broadcasts and each S value once per 4 keys.
// Step 2, S[k][j] = D[k] S[k][j] (+/-) sum_c M2[c][k] X[c][j]: a thread takes 4-key groups
// g = warp + 8m (keys 4g .. 4g + 3) of its column, again float4 broadcasts of M2.
template <bool BACKWARD>
__global__ void __launch_bounds__(kWarps * 32) chunk_kernel(DeltaChunkArgs p) {
  extern __shared__ __align__(16) float smem[];
  const int dk = p.key_dim, c_rows = p.chunk, dv = p.value_dim;
  float* S = smem;                // [dk][32]
  float* m1 = S + dk * kColumns;  // [C][dk]: W (forward) or Kt (backward)
  float* m2 = m1 + c_rows * dk;   // [C][dk]: Kt (forward) or W (backward)
  float* X = m2 + c_rows * dk;    // [C][32]
  const int bh = blockIdx.x, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int col = blockIdx.y * kColumns + lane;
  const bool valid = col < dv;
  const int groups = dk / 4;
  const int64_t state_base = static_cast<int64_t>(bh) * dk * dv;
  for (int k = warp; k < dk; k += kWarps) {
    S[k * kColumns + lane] =
        valid ? p.state_in[state_base + static_cast<int64_t>(k) * dv + col] : 0.f;
  }
  for (int step = 0; step < p.chunks; ++step) {
    const int i = BACKWARD ? p.chunks - 1 - step : step;
    const int64_t chunk_index = static_cast<int64_t>(bh) * p.chunks + i;
    const float* w = p.w + chunk_index * c_rows * dk;
    const float* kt = p.kt + chunk_index * c_rows * dk;
    const float* first = BACKWARD ? kt : w;
    const float* second = BACKWARD ? w : kt;
    __syncthreads();  // the previous chunk is done with m1, m2, X and S
    for (int e = threadIdx.x * 4; e < c_rows * dk; e += kWarps * 32 * 4) {
      *reinterpret_cast<float4*>(m1 + e) = *reinterpret_cast<const float4*>(first + e);
      *reinterpret_cast<float4*>(m2 + e) = *reinterpret_cast<const float4*>(second + e);
    }
    const float* x = p.x + chunk_index * c_rows * dv;
    for (int c = warp; c < c_rows; c += kWarps) {
      X[c * kColumns + lane] = valid ? x[static_cast<int64_t>(c) * dv + col] : 0.f;
    }
    float* state_i = p.per_chunk_state + chunk_index * dk * dv;
    if (valid) {
      for (int k = warp; k < dk; k += kWarps) {
        state_i[static_cast<int64_t>(k) * dv + col] = S[k * kColumns + lane];
      }
    }
    __syncthreads();

    float acc[kRowsPerWarp] = {};
    for (int k = 0; k < dk; k += 4) {
      const float s0 = S[k * kColumns + lane], s1 = S[(k + 1) * kColumns + lane];
      const float s2 = S[(k + 2) * kColumns + lane], s3 = S[(k + 3) * kColumns + lane];
#pragma unroll
      for (int m = 0; m < kRowsPerWarp; ++m) {
        const int c = warp + kWarps * m;
        if (c < c_rows) {
          const float4 a = *reinterpret_cast<const float4*>(m1 + c * dk + k);
          acc[m] += a.x * s0 + a.y * s1 + a.z * s2 + a.w * s3;
        }
      }
    }
    float* y = p.y + chunk_index * c_rows * dv;
#pragma unroll
    for (int m = 0; m < kRowsPerWarp; ++m) {
      const int c = warp + kWarps * m;
      if (c < c_rows) {
        const float value = X[c * kColumns + lane] + (BACKWARD ? acc[m] : -acc[m]);
        X[c * kColumns + lane] = value;
        if (valid) y[static_cast<int64_t>(c) * dv + col] = value;
      }
    }
    __syncthreads();

    float4 sum[kGroupsPerWarp];
#pragma unroll
    for (int m = 0; m < kGroupsPerWarp; ++m) sum[m] = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int c = 0; c < c_rows; ++c) {
      const float xv = X[c * kColumns + lane];
#pragma unroll
      for (int m = 0; m < kGroupsPerWarp; ++m) {
        const int g = warp + kWarps * m;
        if (g < groups) {
          const float4 a = *reinterpret_cast<const float4*>(m2 + c * dk + 4 * g);
          sum[m].x += a.x * xv;
          sum[m].y += a.y * xv;
          sum[m].z += a.z * xv;
          sum[m].w += a.w * xv;
        }
      }
    }
    const float* decay = p.decay + chunk_index * dk;
    const float* grad_in = BACKWARD ? p.state_grad_in + chunk_index * dk * dv : nullptr;
#pragma unroll
    for (int m = 0; m < kGroupsPerWarp; ++m) {
      const int g = warp + kWarps * m;
      if (g < groups) {
        const float parts[4] = {sum[m].x, sum[m].y, sum[m].z, sum[m].w};
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const int k = 4 * g + r;
          float next = decay[k] * S[k * kColumns + lane] + (BACKWARD ? -parts[r] : parts[r]);
          if (BACKWARD && valid) next += grad_in[static_cast<int64_t>(k) * dv + col];
          S[k * kColumns + lane] = next;
        }
      }
    }
  }
  __syncthreads();
  if (valid) {
    for (int k = warp; k < dk; k += kWarps) {
      p.state_out[state_base + static_cast<int64_t>(k) * dv + col] = S[k * kColumns + lane];
    }
  }
}

template <bool BACKWARD>
cudaError_t launch(const DeltaChunkArgs& a, cudaStream_t stream) {
  if (a.batch_heads <= 0 || a.chunks < 0 || a.chunk <= 0 || a.chunk > kDeltaChunkMaxChunk ||
      a.key_dim <= 0 || a.key_dim > kDeltaChunkMaxKeyDim || a.key_dim % 4 != 0 ||
      a.value_dim <= 0 || !a.x || !a.w || !a.kt || !a.decay || !a.state_in || !a.per_chunk_state ||
      !a.y || !a.state_out || (BACKWARD && !a.state_grad_in) ||
      (a.value_dim + kColumns - 1) / kColumns > 65535) {
    return cudaErrorInvalidValue;
  }
  // float4 reads of the chunk tiles: every tile starts 16-byte aligned.
  for (const float* ptr : {a.w, a.kt}) {
    if (reinterpret_cast<uintptr_t>(ptr) % 16 != 0) return cudaErrorInvalidValue;
  }
  const size_t bytes = shared_bytes(a);
  cudaError_t err = cudaFuncSetAttribute(
      chunk_kernel<BACKWARD>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
  if (err != cudaSuccess) return err;
  const dim3 grid(static_cast<unsigned>(a.batch_heads),
                  static_cast<unsigned>((a.value_dim + kColumns - 1) / kColumns));
  chunk_kernel<BACKWARD><<<grid, kWarps * 32, bytes, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace

cudaError_t delta_chunk_forward(const DeltaChunkArgs& args, cudaStream_t stream) {
  return launch<false>(args, stream);
}

cudaError_t delta_chunk_backward(const DeltaChunkArgs& args, cudaStream_t stream) {
  return launch<true>(args, stream);
}

}  // namespace mhla_kernels
