// The forward output of a chunk, o = scale [(exp(G) . Q) S_i + P u] with the decayed causal
// scores P = (Q K^T) . D (D_rs = exp(G_r - G_s), s <= r). Gated DeltaNet forms P here and keeps
// it (the backward's state walk reads it for P^T dO); KDA reads P and exp(G) . Q from its prepare
// pass instead.
//
// Persistent CTAs of two warpgroups, each group taking half of the value columns of every
// chunk.
// The tensor copy engine brings each chunk's Q (or exp(G) . Q), K, u, S_i, G (or P) into one of
// two stages while the chunk before is computed. Q K^T is a wgmma into the group's registers
// (every group forms it: cheaper than sharing it), decayed and masked there; Q S_i and P u follow
// per warp on tensor cores (mma.sync) into one accumulator, P straight from registers.
#include <algorithm>

#include "common/device_info.h"
#include "common/tensor_copy.cuh"
#include "common/tensor_map.h"
#include "common/warpgroup_mma.cuh"
#include "gated_delta/chunk_passes.h"
#include "gated_delta/chunk_tiles.cuh"

namespace mhla_kernels {
namespace gated_delta {
namespace {

namespace wg = warpgroup;
namespace tc = tensor_copy;
using wg::CoreTile;

constexpr int kGroups =
    2;  // warpgroups, each taking D / 2 of the value columns (call 11: 4 were slower)
constexpr int kThreads = 128 * kGroups;

// One stage of shared memory (bytes): Q (or exp(G) . Q), K (gated DeltaNet) or P (KDA), u, S_i, G.
template <int D>
struct OutputStage {
  static constexpr size_t tile = 2 * kC * D, state = 2 * D * D, square = 2 * kC * kC;
  static constexpr size_t q = 0, k = q + tile, u = k + tile, st = u + tile, g = st + state,
                          bytes = g + 4 * kC;
  static constexpr size_t p = k;  // KDA: P in K's place
  // Stages (and their barriers): two while persistent; one beside a pipelined walk, so that an
  // output CTA still fits an SM beside a walk CTA.
  static constexpr size_t total(int stages) { return stages * (bytes + 8); }
};

struct OutputMaps {
  CUtensorMap q, k, u, states, q_gated, scores;
};

template <typename T, int D, bool PerKey, int Stages>
__global__ void __launch_bounds__(kThreads, 1)
    output_kernel(GatedDeltaArgs p, const __grid_constant__ OutputMaps maps) {
  using S = OutputStage<D>;
  using Rows64 = CoreTile<T, D, kC>;
  extern __shared__ __align__(128) unsigned char raw[];
  uint64_t* bars = reinterpret_cast<uint64_t*>(raw + Stages * S::bytes);
  const int range = range_end(p) - p.chunk_begin, items = range * p.batch * p.heads;
  auto position = [&](int item) {
    return ChunkPosition(p, item / range, p.chunk_begin + item % range);
  };
  // One thread starts the copies of `item` into stage `stage`.
  auto issue = [&](int item, int stage) {
    if (threadIdx.x != 0 || item >= items) return;
    const ChunkPosition at = position(item);
    const int64_t chunk_index = static_cast<int64_t>(at.bh) * at.chunks + at.chunk;
    unsigned char* base = raw + stage * S::bytes;
    uint64_t* bar = bars + stage;
    if constexpr (PerKey) {
      tc::arrive_expecting(bar, 2 * S::tile + S::state + S::square);
      tc::copy_matrix_rows(base + S::q, &maps.q_gated, static_cast<int>(chunk_index * kC), bar);
      tc::copy_matrix_rows(base + S::p, &maps.scores, static_cast<int>(chunk_index * kC), bar);
    } else {
      tc::arrive_expecting(bar, 3 * S::tile + S::state + 4 * kC);
      tc::copy_token_rows(base + S::q, &maps.q, at.t0, at.h, at.b, bar);
      tc::copy_token_rows(base + S::k, &maps.k, at.t0, at.h, at.b, bar);
      tc::copy_bytes(base + S::g, p.gate_sums + chunk_index * kC, 4 * kC, bar);
    }
    tc::copy_matrix_rows(base + S::u, &maps.u, static_cast<int>(chunk_index * kC), bar);
    tc::copy_matrix_rows(base + S::st, &maps.states, static_cast<int>(chunk_index * D), bar);
  };
  if (threadIdx.x == 0) {
    for (int s = 0; s < Stages; ++s) tc::init(bars + s);
    tc::fence_init();
  }
  __syncthreads();
  for (int s = 0; s < Stages; ++s) issue(blockIdx.x + s * gridDim.x, s);

  constexpr int kPart = D / kGroups;
  const int part = threadIdx.x / 128, strip = 16 * ((threadIdx.x / 32) % 4);
  const int col0 = part * kPart;
  int count = 0;
  for (int item = blockIdx.x; item < items; item += gridDim.x, ++count) {
    const int stage = count % Stages;
    unsigned char* base = raw + stage * S::bytes;
    const Rows64 q{reinterpret_cast<T*>(base + S::q)}, u{reinterpret_cast<T*>(base + S::u)};
    const CoreTile<T, D, D> st{reinterpret_cast<T*>(base + S::st)};
    tc::wait(bars + stage, (count / Stages) & 1);
    const ChunkPosition at = position(item);
    float acc[kPart / 2];
#pragma unroll
    for (int i = 0; i < kPart / 2; ++i) acc[i] = 0.f;
    if constexpr (PerKey) {
      // exp(G) . Q and P from the prepare pass.
      const CoreTile<T, kC, kC> scores{reinterpret_cast<T*>(base + S::p)};
      wg::strip_product<T, false, false, kPart / 16>(acc, 0, q, strip, st, col0, 0, D);
      wg::strip_product<T, false, false, kPart / 16>(acc, 0, scores, strip, u, col0, 0, strip + 16);
    } else {
      const Rows64 k{reinterpret_cast<T*>(base + S::k)};
      const float* g = reinterpret_cast<const float*>(base + S::g);
      float scores[32];
      wg::fence();
      wg::product<T, kC, D>(scores, q, 0, 0, k, 0, 0, false);  // Q K^T, while Q S_i runs
      wg::strip_product<T, false, false, kPart / 16>(acc, 0, q, strip, st, col0, 0, D);
      const int r_lo = wg::acc_row(0), r_hi = wg::acc_row(2);
      const float e_lo = __expf(g[r_lo]), e_hi = __expf(g[r_hi]);
#pragma unroll
      for (int i = 0; i < kPart / 2; ++i) acc[i] *= (i % 4) >= 2 ? e_hi : e_lo;
      wg::wait<0>();
      wg::pin(scores);
#pragma unroll
      for (int i = 0; i < 32; ++i) {
        const int r = wg::acc_row(i), s = wg::acc_col(i);
        scores[i] = s <= r ? scores[i] * __expf(g[r] - g[s]) : 0.f;
      }
      if (part == 0) {  // kept for the backward
        T* out = static_cast<T*>(p.scores) + at.tile(0, kC);
#pragma unroll
        for (int i = 0; i < 32; i += 2) {
          *reinterpret_cast<unsigned*>(out + wg::acc_row(i) * kC + wg::acc_col(i)) =
              wg::pack_pair<T>(scores[i], scores[i + 1]);
        }
      }
      unsigned frag[4][4];
      wg::to_a_fragments<T>(scores, frag);
      wg::strip_product_from_registers<T, false, kPart / 16>(acc, 0, frag, u, col0, 0, strip + 16);
    }
    T* out = static_cast<T*>(p.out) + at.token(0, D, p.heads, p.tokens);
    const int stride = p.heads * D;
#pragma unroll
    for (int i = 0; i < kPart / 2; i += 2) {
      const int r = wg::acc_row(i);
      if (r < at.valid) {
        *reinterpret_cast<unsigned*>(out + static_cast<int64_t>(r) * stride + col0 +
                                     wg::acc_col(i)) =
            wg::pack_pair<T>(p.scale * acc[i], p.scale * acc[i + 1]);
      }
    }
    __syncthreads();  // the stage is free: the chunk after next comes into it
    issue(item + Stages * gridDim.x, stage);
  }
}

template <typename T, int D>
struct Output {
  static cudaError_t launch(const GatedDeltaArgs& a, cudaStream_t stream) {
    OutputMaps maps{};
    const int chunks = gated_delta_chunks(a.tokens);
    const int64_t tile_rows = static_cast<int64_t>(a.batch) * a.heads * chunks * kC;
    const int64_t state_rows = static_cast<int64_t>(a.batch) * a.heads * chunks * D;
    cudaError_t err = encode_matrix_rows_map(&maps.u, a.u, tile_rows, D, kC);
    if (err == cudaSuccess) err = encode_matrix_rows_map(&maps.states, a.states, state_rows, D, D);
    if (a.per_key_gate) {
      if (err == cudaSuccess)
        err = encode_matrix_rows_map(&maps.q_gated, a.q_gated, tile_rows, D, kC);
      if (err == cudaSuccess)
        err = encode_matrix_rows_map(&maps.scores, a.scores, tile_rows, kC, kC);
    } else {
      if (err == cudaSuccess) {
        err = encode_token_rows_map(&maps.q, a.q, a.batch, a.tokens, a.heads, D, kC);
      }
      if (err == cudaSuccess) {
        err = encode_token_rows_map(&maps.k, a.k, a.batch, a.tokens, a.heads, D, kC);
      }
    }
    if (err != cudaSuccess) return err;
    const dim3 one_each = chunk_grid(a);
    const int items = static_cast<int>(one_each.x * one_each.y);
    // Persistent over the whole sequence; beside a pipelined walk, a CTA per chunk (the walk
    // keeps its SMs).
    const bool whole = a.chunk_begin == 0 && a.chunk_end == 0;
    const int grid = whole ? std::min(items, multiprocessors()) : items;
    auto run = [&](auto kernel, int stages) {
      const size_t bytes = OutputStage<D>::total(stages);
      cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(bytes));
      if (e != cudaSuccess) return e;
      kernel<<<grid, kThreads, bytes, stream>>>(a, maps);
      return cudaGetLastError();
    };
    if (whole) {
      return a.per_key_gate ? run(output_kernel<T, D, true, 2>, 2)
                            : run(output_kernel<T, D, false, 2>, 2);
    }
    return a.per_key_gate ? run(output_kernel<T, D, true, 1>, 1)
                          : run(output_kernel<T, D, false, 1>, 1);
  }
};

}  // namespace

cudaError_t run_output(const GatedDeltaArgs& a, cudaStream_t stream) {
  return dispatch<Output>(a, stream);
}

}  // namespace gated_delta
}  // namespace mhla_kernels
