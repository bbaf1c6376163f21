// dS_j = sum_i m_ij dS'_i and dm_ij += sum dS'_i * S_j in one pass (see block_mix_backward.h).
//
// Persistent CTAs walk items of (batch*head, column of the states). An item's rows of dS' and of S
// (padded to Rows = 16 or 32) are copied into shared memory with cp.async while the items before
// it are computed (a ring of stages). Thread t owns one four-element column quad and one role: a 4
// x 16 corner of dm (rows 4 * (role / halves), 16 columns from 16 * (role % halves)) kept in 64
// registers over every item (16 FMAs per row of S read), and Rows / roles rows of dS for its quad
// (4 FMAs per row of dS' read and row written). Rows past `blocks` and elements past the end are
// zero in shared memory, so they add nothing. At the end each corner is summed over its threads
// (shuffles, then shared memory) and added to grad_mixing once per CTA.
#include <algorithm>
#include <cstdlib>
#include <string>

#include <cuda_bf16.h>

#include "common/async_copy.cuh"
#include "common/device_info.h"
#include "mhla/block_mix_backward.h"
#include "mhla/packed_mix.cuh"

namespace mhla_kernels {
namespace {

constexpr int kThreads = 256;

template <int Rows>
struct MixShape {
  static constexpr int halves = Rows / 16;              // 16-column halves of a dm row
  static constexpr int roles = (Rows / 4) * halves;     // dm corners: 4 (16) or 16 (32)
  static constexpr int quads = kThreads / roles;        // columns of four per item: 64 or 16
  static constexpr int columns = 4 * quads;             // elements per item: 256 or 64
  static constexpr int out_rows = Rows / roles;         // dS rows per thread: 4 or 2
  static constexpr int stage_quads = 2 * Rows * quads;  // dS' rows, then S rows: 32 or 16 KB
  // Stages in the ring: two (one item copying while one is computed). Three stages for 16 rows
  // and four for 32 were no faster (session 20, call 4: 95 against 87 us, 372 against 366 us).
  static constexpr int stages = 2;
  static constexpr size_t shared_bytes = static_cast<size_t>(stages) * stage_quads * 16;
  static_assert(kThreads % roles == 0 && (quads % 32 == 0 || quads == 16), "whole warps per role");
};

__device__ __forceinline__ void fma4(float4& acc, float w, const float4& x) {
  acc.x = fmaf(w, x.x, acc.x);
  acc.y = fmaf(w, x.y, acc.y);
  acc.z = fmaf(w, x.z, acc.z);
  acc.w = fmaf(w, x.w, acc.w);
}

using packed_mix::dot4;  // shared with the packed kernel

template <int Rows>
__global__ void __launch_bounds__(kThreads, 2) mix_backward_kernel(BlockMixBackward p) {
  using S = MixShape<Rows>;
  extern __shared__ __align__(16) float4 stages[];  // [S::stages][2][Rows][quads]
  __shared__ float weights[Rows][Rows];             // zero outside the matrix
  __shared__ float corner[kThreads / 32][4][16];    // per-warp sums of the dm corners
  const int t = threadIdx.x, q = t % S::quads, role = t / S::quads;
  const int row0 = 4 * (role / S::halves), col0 = 16 * (role % S::halves);
  const int out0 = role * S::out_rows;  // first dS row of this thread
  for (int e = t; e < Rows * Rows; e += kThreads) {
    const int i = e / Rows, j = e % Rows;
    weights[i][j] = i < p.blocks && j < p.blocks ? p.mixing[i * p.blocks + j] : 0.f;
  }
  const int64_t columns = (p.elements + S::columns - 1) / S::columns;
  const int64_t items = static_cast<int64_t>(p.batch_heads) * columns;
  // Thread t copies rows role, role + roles, ... of its quad, of dS' and of S.
  auto issue = [&](int64_t item, int stage) {
    const int64_t bh = item / columns, e = (item % columns) * S::columns + 4 * q;
    const size_t base = static_cast<size_t>(bh) * p.blocks * p.elements;
    float4* dst = stages + stage * S::stage_quads + q;
#pragma unroll
    for (int u = 0; u < Rows / S::roles; ++u) {
      const int r = role + S::roles * u;
      const bool in = r < p.blocks && e < p.elements;
      const size_t at = base + (in ? static_cast<size_t>(r) * p.elements + e : 0);
      async_copy::copy_streaming16(dst + r * S::quads, p.grad_mixed + at, in);
      async_copy::copy_streaming16(dst + (Rows + r) * S::quads, p.states + at, in);
    }
    asm volatile("cp.async.commit_group;\n" ::);
  };
  float dm[4][16];
#pragma unroll
  for (int a = 0; a < 4; ++a) {
#pragma unroll
    for (int j = 0; j < 16; ++j) dm[a][j] = 0.f;
  }
  // A ring of stages: item n of this CTA lives in stage n % stages. Every iteration commits one
  // group (empty past the end), so "all but the newest stages - 1 groups" is always item n's.
  auto issue_or_empty = [&](int64_t item, int stage) {
    if (item < items)
      issue(item, stage);
    else
      asm volatile("cp.async.commit_group;\n" ::);
  };
  for (int s = 0; s + 1 < S::stages; ++s) issue_or_empty(blockIdx.x + int64_t{s} * gridDim.x, s);
  int stage = 0;
  for (int64_t item = blockIdx.x; item < items; item += gridDim.x) {
    // The stage before this one was last read before the previous trailing barrier.
    const int refill = stage == 0 ? S::stages - 1 : stage - 1;
    issue_or_empty(item + int64_t{S::stages - 1} * gridDim.x, refill);
    asm volatile("cp.async.wait_group %0;\n" ::"n"(S::stages - 1));
    __syncthreads();  // this item's copies (every thread's) and the weights are in
    const float4* x = stages + stage * S::stage_quads;  // dS' rows
    const float4* y = x + Rows * S::quads;              // S rows
    const int64_t bh = item / columns, e = (item % columns) * S::columns + 4 * q;
    // dS_j for this thread's rows j: sum over i of m_ij dS'_i.
    float4 out[S::out_rows] = {};
#pragma unroll 4
    for (int i = 0; i < Rows; ++i) {
      const float4 xi = x[i * S::quads + q];
#pragma unroll
      for (int a = 0; a < S::out_rows; ++a) fma4(out[a], weights[i][out0 + a], xi);
    }
    if (e < p.elements && p.packed_matrix == 0) {
      float* dst = p.grad_states + static_cast<size_t>(bh) * p.blocks * p.elements + e;
#pragma unroll
      for (int a = 0; a < S::out_rows; ++a) {
        const int j = out0 + a;
        if (j < p.blocks)
          *reinterpret_cast<float4*>(dst + static_cast<size_t>(j) * p.elements) = out[a];
      }
    } else if (e < p.elements) {  // packed: four bf16 (8 bytes) in the matrix part, else fp32
      const int64_t row = p.packed_matrix / 2 + p.elements - p.packed_matrix;
#pragma unroll
      for (int a = 0; a < S::out_rows; ++a) {
        const int j = out0 + a;
        if (j >= p.blocks) continue;
        float* state = p.grad_states + (static_cast<size_t>(bh) * p.blocks + j) * row;
        if (e < p.packed_matrix) {
          const __nv_bfloat162 pair[2] = {__floats2bfloat162_rn(out[a].x, out[a].y),
                                          __floats2bfloat162_rn(out[a].z, out[a].w)};
          *reinterpret_cast<uint2*>(reinterpret_cast<__nv_bfloat16*>(state) + e) =
              *reinterpret_cast<const uint2*>(pair);
        } else {
          *reinterpret_cast<float4*>(state + p.packed_matrix / 2 + e - p.packed_matrix) = out[a];
        }
      }
    }
    // dm_ij += dS'_i . S_j over this thread's corner.
    float4 own[4];
#pragma unroll
    for (int a = 0; a < 4; ++a) own[a] = x[(row0 + a) * S::quads + q];
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const float4 yj = y[(col0 + j) * S::quads + q];
#pragma unroll
      for (int a = 0; a < 4; ++a) dm[a][j] = dot4(own[a], yj, dm[a][j]);
    }
    __syncthreads();  // done with this stage before the next iteration refills it
    stage = stage + 1 == S::stages ? 0 : stage + 1;
  }
  asm volatile("cp.async.wait_group 0;\n" ::);  // no copy may land after the stages are reused
  // Sum the corners over the warp's lanes (every lane of a warp has the same role when quads is a
  // multiple of 32; with 16 quads a warp holds two roles, summed over their own 16 lanes), then
  // over the warps of a role. Over the lanes as a reduce-scatter: at each step a lane keeps half
  // of its values and adds its partner's half, so 32 lanes end with two sums each after 62
  // shuffles instead of a butterfly of all 64 values (320 shuffles and adds a thread, as much
  // as 1.5 items' work when the CTAs have one or two items: N = 16,384, session 44).
  constexpr int kLanesPerRole = S::quads < 32 ? S::quads : 32;
  constexpr int kKept = 64 / kLanesPerRole;  // sums per lane at the end
  const int warp = t / 32, lane = t % 32;
  float v[64];
#pragma unroll
  for (int a = 0; a < 4; ++a) {
#pragma unroll
    for (int j = 0; j < 16; ++j) v[a * 16 + j] = dm[a][j];
  }
  // Step with offset o halves the values: the lane with bit o set keeps the upper half.
  int first = 0;  // flat index (a * 16 + j) of v[0] once the steps are done
  constexpr int kSteps = kLanesPerRole == 32 ? 5 : 4;
#pragma unroll
  for (int step = 0; step < kSteps; ++step) {
    const int offset = kLanesPerRole >> (step + 1), half = 32 >> step;
    const bool upper = lane & offset;
#pragma unroll
    for (int i = 0; i < 32; ++i) {
      if (i < half) {
        const float send = upper ? v[i] : v[i + half];
        const float keep = upper ? v[i + half] : v[i];
        v[i] = keep + __shfl_xor_sync(0xffffffffu, send, offset);
      }
    }
    if (upper) first += half;
  }
  __syncthreads();  // the stages are free: per-role sums go there when a warp holds two roles
  float* role_sums = reinterpret_cast<float*>(stages);  // [roles][4][16]
  if constexpr (S::quads >= 32) {
#pragma unroll
    for (int i = 0; i < kKept; ++i) (&corner[warp][0][0])[first + i] = v[i];
    __syncthreads();
    constexpr int kWarpsPerRole = S::quads / 32;
    for (int e = t; e < S::roles * 64; e += kThreads) {
      const int r = e / 64, a = (e / 16) % 4, j = e % 16;
      float sum = 0.f;
      for (int w = 0; w < kWarpsPerRole; ++w) sum += corner[r * kWarpsPerRole + w][a][j];
      role_sums[e] = sum;
    }
  } else {
#pragma unroll
    for (int i = 0; i < kKept; ++i) role_sums[role * 64 + first + i] = v[i];
  }
  __syncthreads();
  for (int e = t; e < S::roles * 64; e += kThreads) {
    const int r = e / 64, a = (e / 16) % 4, jj = e % 16;
    const int i = 4 * (r / S::halves) + a, j = 16 * (r % S::halves) + jj;
    if (i >= p.blocks || j >= p.blocks) continue;
    if (p.grad_mixing_parts != nullptr) {
      p.grad_mixing_parts[(static_cast<size_t>(blockIdx.x) * p.blocks + i) * p.blocks + j] =
          role_sums[e];
    } else {
      atomicAdd(p.grad_mixing + i * p.blocks + j, role_sums[e]);
    }
  }
}

// Persistent CTAs: as many as fit on the GPU, at most one per item (0: no items; -1: the
// kernel cannot be configured). Every CTA has an item.
template <typename Kernel>
int64_t persistent_ctas(Kernel kernel, size_t shared_bytes, int64_t items) {
  if (items <= 0) return 0;
  int per_sm = 0;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, shared_bytes) !=
          cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, shared_bytes) !=
          cudaSuccess)
    return -1;
  return std::min<int64_t>(items, static_cast<int64_t>(std::max(per_sm, 1)) * multiprocessors());
}

template <int Rows>
int64_t ctas_for(const BlockMixBackward& p) {
  using S = MixShape<Rows>;
  return persistent_ctas(
      mix_backward_kernel<Rows>, S::shared_bytes,
      static_cast<int64_t>(p.batch_heads) * ((p.elements + S::columns - 1) / S::columns));
}

template <int Rows>
cudaError_t launch(const BlockMixBackward& p, cudaStream_t stream) {
  const int64_t ctas = ctas_for<Rows>(p);
  if (ctas == 0) return cudaSuccess;
  if (ctas < 0) return cudaErrorInvalidConfiguration;
  mix_backward_kernel<Rows>
      <<<static_cast<unsigned>(ctas), kThreads, MixShape<Rows>::shared_bytes, stream>>>(p);
  return cudaGetLastError();
}

// Packed inputs: the matrix part and the rest in one kernel (packed_mix.cuh).
packed_mix::PackedMix packed_args(const BlockMixBackward& p) {
  packed_mix::PackedMix args;
  args.in = p.grad_mixed, args.states = p.states, args.mixing = p.mixing;
  args.out = p.grad_states, args.grad_mixing = p.grad_mixing;
  args.grad_mixing_parts = p.grad_mixing_parts;
  args.batch_heads = p.batch_heads, args.blocks = p.blocks;
  args.elements = p.elements, args.matrix = p.packed_inputs_matrix;
  return args;
}
bool direct_stores() {
  static const bool direct = [] {
    const char* value = std::getenv("MHLA_MIX_BACKWARD_STORES");
    return value != nullptr && std::string(value) == "direct";
  }();
  return direct;
}
cudaError_t launch_packed(const BlockMixBackward& p, cudaStream_t stream) {
  const auto args = packed_args(p);
  return direct_stores() ? packed_mix::launch<true, false>(args, multiprocessors(), stream)
                         : packed_mix::launch<true, true>(args, multiprocessors(), stream);
}

}  // namespace

bool block_mix_backward_supported(int blocks, int64_t elements) {
  return blocks >= 1 && blocks <= kMixBackwardMaxBlocks && elements > 0 && elements % 4 == 0;
}

bool block_mix_backward_takes_packed(int blocks, int64_t packed_inputs_matrix) {
  if (packed_inputs_matrix == 0) return true;
  return packed_inputs_matrix > 0 && blocks >= 1 && blocks <= packed_mix::kRows &&
         packed_inputs_matrix % packed_mix::kColumns == 0;
}

int64_t block_mix_backward_parts(const BlockMixBackward& p) {
  if (p.packed_inputs_matrix > 0) {
    const auto args = packed_args(p);
    return direct_stores() ? packed_mix::grid_for<true, false>(args, multiprocessors())
                           : packed_mix::grid_for<true, true>(args, multiprocessors());
  }
  return p.blocks <= 16 ? ctas_for<16>(p) : ctas_for<32>(p);
}

cudaError_t block_mix_backward(const BlockMixBackward& p, cudaStream_t stream) {
  if (p.grad_mixed == nullptr || p.states == nullptr || p.mixing == nullptr ||
      p.grad_states == nullptr || p.grad_mixing == nullptr || p.batch_heads <= 0 ||
      !block_mix_backward_supported(p.blocks, p.elements) || p.packed_matrix < 0 ||
      p.packed_matrix % 8 != 0 || p.packed_matrix > p.elements ||
      !block_mix_backward_takes_packed(p.blocks, p.packed_inputs_matrix))
    return cudaErrorInvalidValue;
  if (p.packed_inputs_matrix > 0) {
    if (p.packed_inputs_matrix != p.packed_matrix) return cudaErrorInvalidValue;
    return launch_packed(p, stream);
  }
  return p.blocks <= 16 ? launch<16>(p, stream) : launch<32>(p, stream);
}

}  // namespace mhla_kernels
