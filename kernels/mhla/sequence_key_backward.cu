// MHLA's mix backward and key pass in one kernel: see sequence_key_backward.h.
//
// One persistent CTA of eight warps per SM takes (batch, head) items last to first (the query
// pass wrote their dS' first to last, so the last are the ones still in L2). Per item:
//   A. the mix: the packed rows of dS'_i and S_j come through a ring of three shared-memory
//      stages of 256 matrix columns (cp.async, two stages in flight while one is used); warp w
//      takes columns 32 w .. 32 w + 31 of each: dm += dS' S^T, and dS = m^T dS' (m as bf16 high
//      and low parts, so the weights keep fp32 precision, as in packed_mix.cuh) into the state
//      tiles. The fp32 z rows come with the first stage: dz_j and dm's z part on CUDA cores.
//   B. the key side: the 4 M strips of 16 token rows, strip s to warp s % 8, each warp alone
//      (key_rows.cuh) over its rows of three 128-row tiles, which the ring aliases. The k and v
//      rows of a warp's next two strips are loaded into registers ahead of it; its first two at
//      the item's start, so they arrive during the mix.
// Besides the ring's barriers, two per item: the mix is complete before any strip reads dS, and
// every strip is done before the next item's ring overwrites the strip tiles.
#include <cuda_bf16.h>

#include <cstdint>
#include <type_traits>

#include "common/async_copy.cuh"
#include "common/device_info.h"
#include "common/wmma_gemm.cuh"
#include "mhla/fragment_rows.cuh"
#include "mhla/key_rows.cuh"
#include "mhla/sequence_key_backward.h"
#include "mhla/tiles.cuh"

namespace mhla_kernels {
namespace {

using E = __nv_bfloat16;
using wmma_tiles::TileAccumulator;
namespace fr = fragment_rows;

constexpr int kD = 64, kTile = 64, kMaxBlocks = 16;
constexpr int kWarps = 8, kThreads = 32 * kWarps;
constexpr int kLd = key_rows::kLd<kD>;  // 72: rows of the state and strip tiles
// State tiles 16 bytes further apart than their rows: the mix stores one element pair of eight
// states at a time, which then fall in eight different bank quads.
constexpr int kStateElements = kD * kLd + 8;
constexpr int kPackedZ = fr::PackedState<kD>::z, kPackedFloats = fr::PackedState<kD>::floats;
constexpr int kSliceColumns = 256, kSliceLd = kSliceColumns + 8;  // rows 16 B apart modulo 128
constexpr int kSlices = kD * kD / kSliceColumns;                   // 16
constexpr int kStages = 3;
constexpr int kStageElements = 2 * kMaxBlocks * kSliceLd;  // dS' rows, then S rows
constexpr int kWeightLd = kMaxBlocks + 8;
constexpr int kStripRows = 16 * kWarps;  // rows of each strip tile: warp w's are 16 w .. + 15
static_assert(kSliceColumns == 32 * kWarps, "each warp takes 32 columns of a stage");
static_assert(kThreads == kMaxBlocks * kMaxBlocks, "one dm pair per thread");

struct SmemPlan {
  static constexpr size_t states = tiles::align128(kMaxBlocks * kStateElements * 2);
  static constexpr size_t dz = kMaxBlocks * kD * 4;
  static constexpr size_t strip_tile = kStripRows * kLd * 2;
  static constexpr size_t strips = 3 * strip_tile;  // phi (then dv), raw k (then dk), raw v
  static constexpr size_t ring = kStages * kStageElements * 2;
  static constexpr size_t scales = kStripRows * 4;
  static constexpr size_t rest = 2 * kMaxBlocks * kD * 4;  // dz'_i, then z_j (fp32)
  static constexpr size_t weights16 = 2 * kMaxBlocks * kWeightLd * 2;
  static constexpr size_t weights32 = kMaxBlocks * kMaxBlocks * 4;
  static constexpr size_t bytes = states + dz + strips + scales + rest + weights16 + weights32;
  static_assert(ring <= strips, "the ring fits in the strip tiles it aliases");
  static_assert(kWarps * kMaxBlocks * kMaxBlocks * 4 <= strips, "dm's warp sums fit there too");
  static_assert(bytes <= 227 * 1024, "one CTA per SM");
};

__device__ __forceinline__ float dot4(const float4& a, const float4& b, float acc) {
  return fmaf(a.w, b.w, fmaf(a.z, b.z, fmaf(a.y, b.y, fmaf(a.x, b.x, acc))));
}

__global__ void __launch_bounds__(kThreads, 1)
    sequence_key_backward_kernel(SequenceKeyBackward p) {
  using R = fr::RowHalves<kD>;
  extern __shared__ __align__(128) unsigned char smem[];
  E* const states = reinterpret_cast<E*>(smem);  // dS_j [d][c], row stride kLd
  float* const dz = reinterpret_cast<float*>(smem + SmemPlan::states);
  unsigned char* const strip_base = smem + SmemPlan::states + SmemPlan::dz;
  E* const phi = reinterpret_cast<E*>(strip_base);
  E* const k_raw = reinterpret_cast<E*>(strip_base + SmemPlan::strip_tile);
  E* const v_raw = reinterpret_cast<E*>(strip_base + 2 * SmemPlan::strip_tile);
  E* const ring = reinterpret_cast<E*>(strip_base);
  float* const scale_rows = reinterpret_cast<float*>(strip_base + SmemPlan::strips);
  float* const rest = scale_rows + kStripRows;  // [dz' rows, z rows][kD]
  E* const weights_hi = reinterpret_cast<E*>(rest + 2 * kMaxBlocks * kD);
  E* const weights_lo = weights_hi + kMaxBlocks * kWeightLd;
  float* const weights = reinterpret_cast<float*>(weights_lo + kMaxBlocks * kWeightLd);

  const auto& s = p.shape;
  const int blocks = s.blocks, pairs = s.batch * s.heads, strips = 4 * blocks;
  const int t = static_cast<int>(threadIdx.x), warp = t / 32;
  // m (zero past M) in fp32 and as bf16 high and low parts; the first item's first barrier
  // orders these writes before their reads.
  {
    const int i = t / kMaxBlocks, j = t % kMaxBlocks;
    const float m = i < blocks && j < blocks ? p.mixing[i * blocks + j] : 0.f;
    weights[t] = m;
    const E hi = __float2bfloat16_rn(m);
    weights_hi[i * kWeightLd + j] = hi;
    weights_lo[i * kWeightLd + j] = __float2bfloat16_rn(m - __bfloat162float(hi));
  }

  // Where state r of (batch, head) bh begins in the packed set of dS' (rows 0-15 of a stage) or
  // of S (rows 16-31); row 0's for rows past M, whose copies zero-fill instead.
  auto state_of = [&](int bh, int row) {
    const int r = row % kMaxBlocks;
    const float* set = row < kMaxBlocks ? p.grad_mixed : p.states;
    return set + (static_cast<size_t>(bh) * blocks + (r < blocks ? r : 0)) * kPackedFloats;
  };
  // Slice `slice` (matrix columns 256 slice ..) of every dS'_i and S_j into ring stage `stage`:
  // thread t takes 16-byte pieces t, t + 256, ...
  auto issue_slice = [&](int bh, int slice, int stage) {
    constexpr int kPiecesPerRow = kSliceColumns / 8;
    E* const stage_rows = ring + stage * kStageElements;
#pragma unroll
    for (int u = 0; u < 2 * kMaxBlocks * kPiecesPerRow / kThreads; ++u) {
      const int piece = t + kThreads * u, row = piece / kPiecesPerRow;
      const int column = 8 * (piece % kPiecesPerRow);
      const E* src = reinterpret_cast<const E*>(state_of(bh, row)) + slice * kSliceColumns + column;
      async_copy::copy_streaming16(stage_rows + row * kSliceLd + column, src,
                                   row % kMaxBlocks < blocks);
    }
  };
  auto issue_rest = [&](int bh) {  // dz'_i and z_j (fp32, after each matrix)
    constexpr int kPiecesPerRow = kD / 4;
#pragma unroll
    for (int u = 0; u < 2 * kMaxBlocks * kPiecesPerRow / kThreads; ++u) {
      const int piece = t + kThreads * u, row = piece / kPiecesPerRow;
      const int column = 4 * (piece % kPiecesPerRow);
      async_copy::copy_streaming16(rest + row * kD + column, state_of(bh, row) + kPackedZ + column,
                                   row % kMaxBlocks < blocks);
    }
  };

  TileAccumulator dm;  // this warp's columns' part of dS' S^T, over the CTA's items
  dm.zero();
  float dm_rest = 0.f;  // pair (t / 16, t % 16): dz'_i . z_j over the CTA's items

  // A stage's 32 columns of this warp: dm += dS' S^T, then dS_j = sum_i m_ij dS'_i into the
  // state tiles (columns 256 slice + 32 warp .. of the row-major D x D matrix: row d, columns
  // 32 (warp % 2) ..).
  auto mix_slice = [&](int slice, int stage) {
    const E* in_rows = ring + stage * kStageElements + 32 * warp;
    wmma_tiles::mma_tile<E, false, true>(dm, in_rows, kSliceLd, in_rows + kMaxBlocks * kSliceLd,
                                         kSliceLd, 0, 0, 32);
    TileAccumulator out[1][2];
    out[0][0].zero();
    out[0][1].zero();
    wmma_tiles::mma_block<E, true, false, 1, 2>(out, weights_hi, kWeightLd, in_rows, kSliceLd, 0,
                                                0, kMaxBlocks);
    wmma_tiles::mma_block<E, true, false, 1, 2>(out, weights_lo, kWeightLd, in_rows, kSliceLd, 0,
                                                0, kMaxBlocks);
    const int d = 4 * slice + warp / 2, c0 = 32 * (warp % 2);
#pragma unroll
    for (int i = 0; i < 4; i += 2) {
      const int r = TileAccumulator::row(i);
      if (r >= blocks) continue;
#pragma unroll
      for (int c = 0; c < 2; ++c) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          *reinterpret_cast<__nv_bfloat162*>(states + r * kStateElements + d * kLd + c0 + 16 * c +
                                             TileAccumulator::col(h, i)) =
              __floats2bfloat162_rn(out[0][c].x[h][i], out[0][c].x[h][i + 1]);
        }
      }
    }
  };

  // The k and v rows of this warp's strips, two ahead, in registers (zeros past the last strip).
  uint4 next_k[2][R::words], next_v[2][R::words];
  auto load_strip = [&](int b, int h, int u, auto buffer) {
    constexpr int x = decltype(buffer)::value;
    const int strip = warp + kWarps * u;
    const int n = 16 * strip + (t % 32) / 2;  // strip s: tokens 16 s .. 16 s + 15, block s / 4
    fr::load_half<E, kD>(p.k, b, n, h, strip < strips, next_k[x]);
    fr::load_half<E, kD>(p.v, b, n, h, strip < strips, next_v[x]);
  };
  // Strip u of this warp: the row form from the registers (phi(k), raw k and v rows, 1/rms(k)),
  // the loads of strip u + 2 into the freed registers, then the products, dk and dv.
  auto key_strip = [&](int b, int h, int u, auto buffer) {
    constexpr int x = decltype(buffer)::value;
    const int strip = warp + kWarps * u;
    const bool mine = strip < strips;  // warp-uniform
    if (mine) {
      const int row = fr::lane_row(), d0 = fr::lane_half() * R::half;
      const float scale = fr::row_scale<E, kD>(next_k[x]);
      fr::features_row<E, kD>(next_k[x], scale, true, phi + row * kLd);
#pragma unroll
      for (int w = 0; w < R::words; ++w) {
        *reinterpret_cast<uint4*>(k_raw + row * kLd + d0 + 8 * w) = next_k[x][w];
        *reinterpret_cast<uint4*>(v_raw + row * kLd + d0 + 8 * w) = next_v[x][w];
      }
      if (fr::lane_half() == 0) scale_rows[row] = scale;
    }
    load_strip(b, h, u + 2, buffer);
    __syncwarp();
    if (mine) {
      const int j = strip / 4;
      TileAccumulator dphi[1][kD / 16];
      key_rows::key_products<E, kD>(dphi, phi, v_raw, states + j * kStateElements, dz + j * kD);
      // The helpers place the warp's rows at tile rows 16 warp ..: token n0 + row is 16 strip ..
      key_rows::key_rows_out<E, kD>(dphi, phi, k_raw, scale_rows, static_cast<E*>(p.grad_k),
                                    static_cast<E*>(p.grad_v), s.tokens, s.heads, b, h,
                                    16 * strip - 16 * warp, 16 * warp + 16);
    }
    __syncwarp();  // the copies' reads of the warp's rows are done before the next strip's writes
  };
  using First = std::integral_constant<int, 0>;
  using Second = std::integral_constant<int, 1>;
  const int strip_steps = (strips + kWarps - 1) / kWarps;

  for (int w = static_cast<int>(blockIdx.x); w < pairs; w += static_cast<int>(gridDim.x)) {
    const int bh = pairs - 1 - w, b = bh / s.heads, h = bh % s.heads;
    __syncthreads();  // the last item's strips are done with the tiles the ring overwrites
    issue_slice(bh, 0, 0);
    issue_rest(bh);
    async_copy::commit();
    issue_slice(bh, 1, 1);
    async_copy::commit();
    load_strip(b, h, 0, First{});
    load_strip(b, h, 1, Second{});

    // A. The mix.
    for (int slice = 0; slice < kSlices; ++slice) {
      async_copy::wait<1>();
      __syncthreads();  // this slice is in (every thread's copies); the stage before it is free
      if (slice + 2 < kSlices) issue_slice(bh, slice + 2, (slice + 2) % kStages);
      async_copy::commit();
      mix_slice(slice, slice % kStages);
    }
    {  // dz_j (columns 4 (t % 16) .. of block t / 16) and dm's z part of pair (t / 16, t % 16)
      const int j = t / kMaxBlocks, c = 4 * (t % kMaxBlocks);
      float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
      for (int i = 0; i < kMaxBlocks; ++i) {
        const float m = weights[i * kMaxBlocks + j];
        const float4 x = *reinterpret_cast<const float4*>(rest + i * kD + c);
        sum.x = fmaf(m, x.x, sum.x), sum.y = fmaf(m, x.y, sum.y);
        sum.z = fmaf(m, x.z, sum.z), sum.w = fmaf(m, x.w, sum.w);
      }
      if (j < blocks) *reinterpret_cast<float4*>(dz + j * kD + c) = sum;
      const float4* grad_row = reinterpret_cast<const float4*>(rest + (t / kMaxBlocks) * kD);
      const float4* z_row =
          reinterpret_cast<const float4*>(rest + (kMaxBlocks + t % kMaxBlocks) * kD);
#pragma unroll
      for (int e = 0; e < kD / 4; ++e) dm_rest = dot4(grad_row[e], z_row[e], dm_rest);
    }
    __syncthreads();  // dS and dz are complete; every warp is done with the ring

    // B. The key side.
    for (int u = 0; u < strip_steps; u += 2) {
      key_strip(b, h, u, First{});
      if (u + 1 < strip_steps) key_strip(b, h, u + 1, Second{});
    }
  }

  // dm: the warps' sums (in the strip tiles, free now), then one addition (or part) per CTA.
  async_copy::wait<0>();
  __syncthreads();
  float* const dm_sums = reinterpret_cast<float*>(strip_base);  // [warp][16 x 16]
#pragma unroll
  for (int h = 0; h < 2; ++h) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      dm_sums[warp * kThreads + TileAccumulator::row(i) * kMaxBlocks + TileAccumulator::col(h, i)] =
          dm.x[h][i];
    }
  }
  __syncthreads();
  float sum = dm_rest;
#pragma unroll
  for (int v = 0; v < kWarps; ++v) sum += dm_sums[v * kThreads + t];
  const int i = t / kMaxBlocks, j = t % kMaxBlocks;
  if (i < blocks && j < blocks) {
    if (p.grad_mixing_parts != nullptr) {
      p.grad_mixing_parts[(static_cast<size_t>(blockIdx.x) * blocks + i) * blocks + j] = sum;
    } else {
      atomicAdd(p.grad_mixing + i * blocks + j, sum);
    }
  }
}

bool aligned16(const void* data) {
  return reinterpret_cast<uintptr_t>(data) % 16 == 0;
}

// A view whose rows can be read in 16-byte words: aligned base, strides of whole words.
bool word_rows(const TokenTensor& t) {
  return aligned16(t.data) && t.batch_stride % 8 == 0 && t.token_stride % 8 == 0 &&
         t.head_stride % 8 == 0;
}

}  // namespace

bool sequence_key_backward_supported(const BlockLinearShape& s, DType dtype) {
  return dtype == DType::bf16 && s.head_dim == kD && s.blocks >= 1 && s.blocks <= kMaxBlocks &&
         s.tokens == kTile * s.blocks && s.batch > 0 && s.heads > 0 &&
         static_cast<int64_t>(s.batch) * s.heads <= 2147483647LL;
}

bool sequence_key_backward_takes(const SequenceKeyBackward& a) {
  return sequence_key_backward_supported(a.shape, a.dtype) && a.mixing != nullptr &&
         a.grad_mixing != nullptr && word_rows(a.k) && word_rows(a.v) &&
         aligned16(a.grad_mixed) && aligned16(a.states) && aligned16(a.grad_k) &&
         aligned16(a.grad_v) && a.grad_mixed != nullptr && a.states != nullptr &&
         a.grad_k != nullptr && a.grad_v != nullptr;
}

int sequence_key_backward_parts(const BlockLinearShape& s) {
  const int pairs = s.batch * s.heads;
  return pairs < multiprocessors() ? pairs : multiprocessors();
}

cudaError_t sequence_key_backward(const SequenceKeyBackward& a, cudaStream_t stream) {
  if (!sequence_key_backward_takes(a)) return cudaErrorInvalidValue;
  cudaError_t err = tiles::allow_smem(sequence_key_backward_kernel, SmemPlan::bytes);
  if (err != cudaSuccess) return err;
  const int grid = sequence_key_backward_parts(a.shape);
  sequence_key_backward_kernel<<<grid, kThreads, SmemPlan::bytes, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace mhla_kernels
