// dS_j = sum_i m_ij dS'_i and dm_ij += sum dS'_i * S_j in one pass (see block_mix_backward.h).
//
// Persistent CTAs walk items of (batch*head, 256-element column). An item's 16 rows of dS' and of
// S (32 KB) are copied into shared memory with cp.async while the previous item is computed (two
// stages). Thread t owns column quad q = t % 64 and row group g = t / 64: it writes dS rows
// 4g..4g+3 of its quad (16 FMAs per row of dS' read) and adds dS'_{4g..4g+3} * S_j for all 16 j
// into 64 registers (16 FMAs per row of S read). Rows past `blocks` and elements past the end are
// zero in shared memory, so they add nothing. At the end each row group's dm corner is summed over
// its threads (shuffles, then shared memory) and added to grad_mixing once per CTA.
#include <algorithm>

#include "common/device_info.h"
#include "mhla/block_mix_backward.h"

namespace mhla_kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kRows = kMixBackwardMaxBlocks;  // rows per item, zero-padded past `blocks`
constexpr int kGroups = kRows / 4;            // row groups of four
constexpr int kQuads = kThreads / kGroups;    // four-element columns per item
constexpr int kColumns = 4 * kQuads;          // 256 elements per item
constexpr int kStageFloats = 2 * kRows * kColumns;  // dS' rows, then S rows
constexpr size_t kSharedBytes = 2 * kStageFloats * sizeof(float);  // two stages: 64 KB

__device__ __forceinline__ void copy_16(float4* dst, const float* src, bool in) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  // src-size 0 fills the 16 bytes with zeros (padding rows, elements past the end).
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(src),
               "r"(in ? 16 : 0));
}

__device__ __forceinline__ void fma4(float4& acc, float w, const float4& x) {
  acc.x = fmaf(w, x.x, acc.x);
  acc.y = fmaf(w, x.y, acc.y);
  acc.z = fmaf(w, x.z, acc.z);
  acc.w = fmaf(w, x.w, acc.w);
}

__device__ __forceinline__ float dot4(const float4& a, const float4& b, float acc) {
  return fmaf(a.w, b.w, fmaf(a.z, b.z, fmaf(a.y, b.y, fmaf(a.x, b.x, acc))));
}

__global__ void __launch_bounds__(kThreads, 2) mix_backward_kernel(BlockMixBackward p) {
  extern __shared__ __align__(16) float4 stages[];  // [2][2][kRows][kQuads]
  __shared__ float4 weights[kRows][kGroups];        // weights[i][g] = m_{i, 4g..4g+3}
  __shared__ float corner[kThreads / 32][4][kRows];  // per-warp sums of the dm corners
  const int t = threadIdx.x, q = t % kQuads, g = t / kQuads;
  for (int e = t; e < kRows * kRows; e += kThreads) {
    const int i = e / kRows, j = e % kRows;
    reinterpret_cast<float*>(weights)[e] =
        i < p.blocks && j < p.blocks ? p.mixing[i * p.blocks + j] : 0.f;
  }
  const int64_t columns = (p.elements + kColumns - 1) / kColumns;
  const int64_t items = static_cast<int64_t>(p.batch_heads) * columns;
  // Thread t copies rows g, g + 4, g + 8, g + 12 of its quad, of dS' and of S.
  auto issue = [&](int64_t item, int stage) {
    const int64_t bh = item / columns, e = (item % columns) * kColumns + 4 * q;
    const size_t base = static_cast<size_t>(bh) * p.blocks * p.elements;
    float4* dst = stages + stage * (kStageFloats / 4) + q;
#pragma unroll
    for (int u = 0; u < kRows / kGroups; ++u) {
      const int r = g + kGroups * u;
      const bool in = r < p.blocks && e < p.elements;
      const size_t at = base + (in ? static_cast<size_t>(r) * p.elements + e : 0);
      copy_16(dst + r * kQuads, p.grad_mixed + at, in);
      copy_16(dst + (kRows + r) * kQuads, p.states + at, in);
    }
    asm volatile("cp.async.commit_group;\n" ::);
  };
  float dm[4][kRows];
#pragma unroll
  for (int a = 0; a < 4; ++a) {
#pragma unroll
    for (int j = 0; j < kRows; ++j) dm[a][j] = 0.f;
  }
  int stage = 0;
  if (blockIdx.x < items) issue(blockIdx.x, 0);
  for (int64_t item = blockIdx.x; item < items; item += gridDim.x, stage ^= 1) {
    const int64_t next = item + gridDim.x;
    if (next < items) {
      issue(next, stage ^ 1);  // that stage was last read before the previous trailing barrier
      asm volatile("cp.async.wait_group 1;\n" ::);
    } else {
      asm volatile("cp.async.wait_group 0;\n" ::);
    }
    __syncthreads();  // this item's copies (every thread's) and the weights are in
    const float4* x = stages + stage * (kStageFloats / 4);  // dS' rows
    const float4* y = x + kRows * kQuads;                    // S rows
    const int64_t bh = item / columns, e = (item % columns) * kColumns + 4 * q;
    // dS_j for j = 4g..4g+3: sum over i of m_ij dS'_i.
    float4 out[4] = {};
#pragma unroll 4
    for (int i = 0; i < kRows; ++i) {
      const float4 xi = x[i * kQuads + q];
      const float4 w = weights[i][g];
      fma4(out[0], w.x, xi);
      fma4(out[1], w.y, xi);
      fma4(out[2], w.z, xi);
      fma4(out[3], w.w, xi);
    }
    if (e < p.elements) {
      float* dst = p.grad_states + static_cast<size_t>(bh) * p.blocks * p.elements + e;
#pragma unroll
      for (int a = 0; a < 4; ++a) {
        const int j = 4 * g + a;
        if (j < p.blocks) *reinterpret_cast<float4*>(dst + static_cast<size_t>(j) * p.elements) = out[a];
      }
    }
    // dm_ij += dS'_i . S_j for i = 4g..4g+3 and every j.
    float4 own[4];
#pragma unroll
    for (int a = 0; a < 4; ++a) own[a] = x[(4 * g + a) * kQuads + q];
#pragma unroll
    for (int j = 0; j < kRows; ++j) {
      const float4 yj = y[j * kQuads + q];
#pragma unroll
      for (int a = 0; a < 4; ++a) dm[a][j] = dot4(own[a], yj, dm[a][j]);
    }
    __syncthreads();  // done with this stage before the next iteration refills it
  }
  // Sum the corners: over the warp's lanes, then over the warps of a row group.
  const int warp = t / 32, lane = t % 32;
#pragma unroll
  for (int a = 0; a < 4; ++a) {
#pragma unroll
    for (int j = 0; j < kRows; ++j) {
      float v = dm[a][j];
#pragma unroll
      for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
      if (lane == 0) corner[warp][a][j] = v;
    }
  }
  __syncthreads();
  constexpr int kWarpsPerGroup = kQuads / 32;
  for (int e = t; e < kRows * kRows; e += kThreads) {
    const int i = e / kRows, j = e % kRows;
    if (i >= p.blocks || j >= p.blocks) continue;
    const int group = i / 4, a = i % 4;
    float sum = 0.f;
    for (int w = 0; w < kWarpsPerGroup; ++w) sum += corner[group * kWarpsPerGroup + w][a][j];
    atomicAdd(p.grad_mixing + i * p.blocks + j, sum);
  }
}

}  // namespace

bool block_mix_backward_supported(int blocks, int64_t elements) {
  return blocks >= 1 && blocks <= kMixBackwardMaxBlocks && elements > 0 && elements % 4 == 0;
}

cudaError_t block_mix_backward(const BlockMixBackward& p, cudaStream_t stream) {
  if (p.grad_mixed == nullptr || p.states == nullptr || p.mixing == nullptr ||
      p.grad_states == nullptr || p.grad_mixing == nullptr || p.batch_heads <= 0 ||
      !block_mix_backward_supported(p.blocks, p.elements))
    return cudaErrorInvalidValue;
  cudaError_t err = cudaFuncSetAttribute(
      mix_backward_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSharedBytes);
  if (err != cudaSuccess) return err;
  int per_sm = 0;
  if ((err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, mix_backward_kernel, kThreads,
                                                           kSharedBytes)) != cudaSuccess)
    return err;
  const int64_t items =
      static_cast<int64_t>(p.batch_heads) * ((p.elements + kColumns - 1) / kColumns);
  const int ctas = static_cast<int>(
      std::min<int64_t>(items, static_cast<int64_t>(std::max(per_sm, 1)) * multiprocessors()));
  mix_backward_kernel<<<ctas, kThreads, kSharedBytes, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace mhla_kernels
