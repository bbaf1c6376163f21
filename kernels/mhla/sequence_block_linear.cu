// One CTA per (batch, head) with the block states in shared memory: sequence_block_linear.h says
// what each pass computes. The token passes are those of token_passes.cuh.
//
// Forward item:  for j: S_j (fp32) -> bf16 tile j and z_j
//                for i: S'_i = sum_j m_ij S_j (fp32 sums of the bf16 tiles) -> output tiles of i
// Backward item: for j: S_j as above
//                for i: S'_i, query tiles of i (dq; dS'_i, dz'_i) -> dS'_i to the global scratch
//                row by row of the state: dm += S dS'^T on tensor cores, then dS_j = sum_i m_ij
//                dS'_i over the same row replaces S_j's row
//                for j: key tiles of j (dk, dv) from dS_j, dz_j
#include "common/device_info.h"
#include "common/packed_access.cuh"
#include "mhla/sequence_block_linear.h"
#include "mhla/token_passes.cuh"

namespace mhla_kernels {
namespace {

using namespace tiles;

constexpr int kMaxBlocks = 16;  // the dm products hold the blocks in one 16 x 16 fragment

// Shared-memory layout for D and M blocks.
template <typename T, int D>
struct SeqSmem {
  using L = Layout<T, D>;
  using E = typename Mma<T>::elem;
  static constexpr size_t state_tile = align128(D * L::lde * sizeof(E));  // one S_j tile
  static constexpr int tile_stride = static_cast<int>(state_tile / sizeof(E));
  static constexpr size_t tile_bytes = align128(kTile * L::lde * sizeof(E));
  static constexpr size_t ftile_bytes = align128(kTile * L::ldf * 4);
  static constexpr size_t state_floats = D * D + D;
  static constexpr size_t work_bytes =
      ftile_bytes > align128(state_floats * 4) ? ftile_bytes : align128(state_floats * 4);
  // dm: the dS' values of one chunk of state elements as bf16 high and low parts,
  // [16 blocks][kChunk + 8] each.
  static constexpr int kChunk = 256;  // state elements per dm step (four rows at D = 64)
  static constexpr int kPerThread = kChunk / 16;  // elements of one block per thread
  static constexpr int ldg = kChunk + 8;
  static constexpr size_t split_bytes = align128(kMaxBlocks * ldg * sizeof(E));
  static_assert(2 * split_bytes <= 4 * tile_bytes, "dm staging must fit the four token tiles");
  static_assert((D * D) % kChunk == 0, "chunks tile the state");
  static_assert(ftile_bytes <= 2 * tile_bytes, "the dv tile must fit the q tiles");
  static size_t common(int blocks) {
    // The dm products read 16 tiles whatever M is: the tiles past M hold garbage that lands in
    // fragment rows nobody reads.
    const int tiles = blocks > 1 ? kMaxBlocks : 1;
    return tiles * state_tile + align128(blocks * D * 4) + align128(D * L::lde * sizeof(E)) +
           align128(D * 4) + align128(blocks * blocks * 4) + align128(kThreads * 4) +
           3 * align128(kTile * 4) + work_bytes;
  }
  static size_t forward(int blocks) { return common(blocks) + 2 * tile_bytes; }
  static size_t backward(int blocks) {
    return common(blocks) + 4 * tile_bytes + align128(kMaxBlocks * kMaxBlocks * 4) +
           align128(8 * 256 * 4);
  }
};

template <typename T, int D>
struct SeqBuffers {
  using E = typename Mma<T>::elem;
  E* states;   // M tensor-core tiles (D x lde), SeqSmem::tile_stride elements apart
  float* zs;   // [M][D]
  E* mixed;    // S'_i tile
  float* mz;   // z'_i
  float* w;    // [M][M]
  float* scratch;
  GradientTiles<T> t;
  float* dm;       // [16][16] (backward): dm products, row j, column i
  float* staging;  // 8 warps x 256 floats (backward): the dm fragments
};

template <typename T, int D>
__device__ SeqBuffers<T, D> carve_buffers(unsigned char* smem, int blocks, bool backward) {
  using S = SeqSmem<T, D>;
  using L = Layout<T, D>;
  using E = typename Mma<T>::elem;
  Carver carve{smem};
  SeqBuffers<T, D> b;
  b.states = carve.take<E>((blocks > 1 ? kMaxBlocks : 1) * S::state_tile);
  b.zs = carve.take<float>(blocks * D * 4);
  b.mixed = carve.take<E>(D * L::lde * sizeof(E));
  b.mz = carve.take<float>(D * 4);
  b.w = carve.take<float>(blocks * blocks * 4);
  b.scratch = carve.take<float>(kThreads * 4);
  b.t.inv_rms = carve.take<float>(kTile * 4);
  b.t.denominator = carve.take<float>(kTile * 4);
  b.t.dden = carve.take<float>(kTile * 4);
  b.t.work = carve.take<float>(S::work_bytes);
  b.t.kf = carve.take<E>(S::tile_bytes);
  b.t.vt = carve.take<E>(S::tile_bytes);
  if (backward) {
    b.t.qf = carve.take<E>(S::tile_bytes);
    b.t.dnum = carve.take<E>(S::tile_bytes);
    b.dm = carve.take<float>(kMaxBlocks * kMaxBlocks * 4);
    b.staging = carve.take<float>(8 * 256 * 4);
  } else {
    b.t.qf = b.t.kf;
    b.t.dnum = nullptr;
    b.dm = nullptr;
    b.staging = nullptr;
  }
  b.t.dv_tile = reinterpret_cast<float*>(b.t.qf);
  return b;
}

// fp32 state (D x D, then z) -> tensor-core tile and normalizer (all threads; no barrier).
template <typename T, int D>
__device__ __forceinline__ void store_state_tile(const float* state,
                                                 typename Mma<T>::elem* tile, float* z) {
  using L = Layout<T, D>;
  using E = typename Mma<T>::elem;
  for (int g = threadIdx.x; g < D * D / 4; g += kThreads) {
    const float4 x = *reinterpret_cast<const float4*>(state + 4 * g);
    const float v[4] = {x.x, x.y, x.z, x.w};
    store_pack<E, 4>(tile + (4 * g / D) * L::lde + (4 * g) % D, v);
  }
  if (threadIdx.x < D) z[threadIdx.x] = state[D * D + threadIdx.x];
}

// out = sum_j weight[j * stride] in_j over M tiles and normalizers (fp32 sums; no barrier).
template <typename T, int D>
__device__ __forceinline__ void mix_tiles(const typename Mma<T>::elem* tiles, const float* zs,
                                          const float* weight, int stride, int blocks,
                                          typename Mma<T>::elem* out, float* out_z) {
  using L = Layout<T, D>;
  using E = typename Mma<T>::elem;
  constexpr int kStride = SeqSmem<T, D>::tile_stride;
  for (int g = threadIdx.x; g < D * D / 8; g += kThreads) {
    const int at = (8 * g / D) * L::lde + (8 * g) % D;
    float sum[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int j = 0; j < blocks; ++j) {
      float x[8];
      load_pack<E, 8>(tiles + j * kStride + at, x);
      const float m = weight[j * stride];
#pragma unroll
      for (int e = 0; e < 8; ++e) sum[e] += m * x[e];
    }
    store_pack<E, 8>(out + at, sum);
  }
  if (threadIdx.x < D) {
    float sum = 0.f;
    for (int j = 0; j < blocks; ++j) sum += weight[j * stride] * zs[j * D + threadIdx.x];
    out_z[threadIdx.x] = sum;
  }
}

// The states S_j of every block of the item, with the next pass's first tile issued at the end.
template <typename T, int D, typename AfterLast>
__device__ void item_states(const SequenceBlockLinearForward& p, int b, int h,
                            SeqBuffers<T, D>& s, TileRows<T, D>& k_rows, TileRows<T, D>& v_rows,
                            AfterLast after_last) {
  const int blocks = p.shape.blocks, length = p.shape.tokens / blocks;
  for (int j = 0; j < blocks; ++j) {
    const Span span{b, h, j * length, (j + 1) * length};
    const Span next{b, h, (j + 1) * length, (j + 2) * length};
    span_state<T, D>(p.k, p.v, span, k_rows, v_rows, s.t.kf, s.t.vt, s.t.work, s.scratch, [&] {
      if (j + 1 < blocks) {
        issue_rows<T, D>(p.k, next, next.begin, k_rows);
        issue_rows<T, D>(p.v, next, next.begin, v_rows);
      } else {
        after_last();
      }
    });
    store_state_tile<T, D>(s.t.work, s.states + j * SeqSmem<T, D>::tile_stride, s.zs + j * D);
  }
  __syncthreads();
}

__device__ __forceinline__ void load_mixing(const float* mixing, int blocks, float* w) {
  for (int e = threadIdx.x; e < blocks * blocks; e += kThreads)
    w[e] = mixing != nullptr ? mixing[e] : 1.f;
}

template <typename T, int D>
__global__ void __launch_bounds__(kThreads, 1)
    sequence_forward_kernel(SequenceBlockLinearForward p) {
  extern __shared__ __align__(128) unsigned char smem[];
  auto s = carve_buffers<T, D>(smem, p.shape.blocks, /*backward=*/false);
  const int items = p.shape.batch * p.shape.heads, blocks = p.shape.blocks;
  const int length = p.shape.tokens / blocks;
  load_mixing(p.mixing, blocks, s.w);
  TileRows<T, D> k_rows, v_rows, q_rows;
  auto first_keys = [&](int item) {
    const Span span{item / p.shape.heads, item % p.shape.heads, 0, length};
    issue_rows<T, D>(p.k, span, 0, k_rows);
    issue_rows<T, D>(p.v, span, 0, v_rows);
  };
  if (blockIdx.x < items) first_keys(blockIdx.x);
  for (int item = blockIdx.x; item < items; item += gridDim.x) {
    const int b = item / p.shape.heads, h = item % p.shape.heads;
    item_states<T, D>(p, b, h, s, k_rows, v_rows, [&] {
      issue_rows<T, D>(p.q, Span{b, h, 0, length}, 0, q_rows);
    });
    for (int i = 0; i < blocks; ++i) {
      __syncthreads();  // the previous block's outputs are done with the mixed tile
      mix_tiles<T, D>(s.states, s.zs, s.w + i * blocks, 1, blocks, s.mixed, s.mz);
      const Span span{b, h, i * length, (i + 1) * length};
      output_tiles<T, D>(p.q, span, p.shape.tokens, p.shape.heads, s.mixed, s.mz, q_rows, s.t.qf,
                         s.t.work, s.t.denominator, static_cast<T*>(p.out), [&] {
                           if (i + 1 < blocks) {
                             issue_rows<T, D>(p.q, Span{b, h, (i + 1) * length, (i + 2) * length},
                                              (i + 1) * length, q_rows);
                           } else if (item + gridDim.x < items) {
                             first_keys(item + gridDim.x);
                           }
                         });
    }
  }
}

// One thread's dS'_i values of a chunk: block i = t / 16, elements (t % 16) * kPerThread ... .
template <int D, int PerThread>
struct ChunkValues {
  float4 x[PerThread / 4];
  __device__ __forceinline__ void load(const float* grad_mixed, int e0, int blocks,
                                       size_t stride) {
    const int i = threadIdx.x / 16, c = (threadIdx.x % 16) * PerThread;
#pragma unroll
    for (int u = 0; u < PerThread / 4; ++u) {
      x[u] = i < blocks ? *reinterpret_cast<const float4*>(grad_mixed + i * stride + e0 + c + 4 * u)
                        : make_float4(0.f, 0.f, 0.f, 0.f);
    }
  }
};

// dm products and dS for one chunk of state elements [e0, e0 + kChunk) of the D x D part, from
// this thread's dS'_i values `v`: dm[j][i] += S_j . dS'_i on tensor cores (dS' split into bf16
// high and low parts, so the products keep ~16 mantissa bits); then S_j's elements of the chunk
// are replaced by dS_j = sum_i m_ij dS'_i.
template <typename T, int D>
__device__ void chunk_products(const ChunkValues<D, SeqSmem<T, D>::kPerThread>& v, int e0,
                               int blocks, SeqBuffers<T, D>& s, FragC<T>& dm_acc, bool want_dm) {
  using S = SeqSmem<T, D>;
  using L = Layout<T, D>;
  using E = typename Mma<T>::elem;
  // [16][ldg] each, over the four token tiles (free between the query and key tiles).
  E* high = s.t.kf;
  E* low = reinterpret_cast<E*>(reinterpret_cast<unsigned char*>(s.t.kf) + S::split_bytes);
  const int i = threadIdx.x / 16, c = (threadIdx.x % 16) * S::kPerThread;
#pragma unroll
  for (int u = 0; u < S::kPerThread / 4; ++u) {
    const float x[4] = {v.x[u].x, v.x[u].y, v.x[u].z, v.x[u].w};
    float hi[4], lo[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      hi[e] = to_float(from_float<E>(x[e]));
      lo[e] = x[e] - hi[e];
    }
    store_pack<E, 4>(high + i * S::ldg + c + 4 * u, hi);
    store_pack<E, 4>(low + i * S::ldg + c + 4 * u, lo);
  }
  __syncthreads();
  if (want_dm) {
    // 16 k-steps of the chunk against the high and the low part: four per warp.
    for (int step = threadIdx.x / 32; step < 2 * S::kChunk / 16; step += kThreads / 32) {
      const int kk = (step % (S::kChunk / 16)) * 16;
      const int row = (e0 + kk) / D, col = (e0 + kk) % D;
      FragA<T, wmma::row_major> fa;  // S rows j: tile j's row `row`, columns col..col+15
      FragB<T, wmma::col_major> fb;  // dS' columns i: part[i][kk..kk+15]
      load_fragment<T>(fa, s.states + row * L::lde + col, S::tile_stride);
      load_fragment<T>(fb, (step < S::kChunk / 16 ? high : low) + kk, S::ldg);
      wmma::mma_sync(dm_acc, fa, fb, dm_acc);
    }
  }
  __syncthreads();  // S's chunk read by the products before dS overwrites it
  const int j = i;  // dS_j for the chunk: thread (j = t / 16, the same elements)
  if (j < blocks) {
#pragma unroll
    for (int u = 0; u < S::kPerThread / 4; ++u) {
      float sum[4] = {0.f, 0.f, 0.f, 0.f};
      for (int src = 0; src < blocks; ++src) {
        float h4[4], l4[4];
        load_pack<E, 4>(high + src * S::ldg + c + 4 * u, h4);
        load_pack<E, 4>(low + src * S::ldg + c + 4 * u, l4);
        const float m = s.w[src * blocks + j];
#pragma unroll
        for (int e = 0; e < 4; ++e) sum[e] += m * (h4[e] + l4[e]);
      }
      const int e = e0 + c + 4 * u;
      store_pack<E, 4>(s.states + j * S::tile_stride + (e / D) * L::lde + e % D, sum);
    }
  }
  __syncthreads();  // the staging is free again
}

template <typename T, int D>
__global__ void __launch_bounds__(kThreads, 1)
    sequence_backward_kernel(SequenceBlockLinearBackward p) {
  using S = SeqSmem<T, D>;
  using L = Layout<T, D>;
  extern __shared__ __align__(128) unsigned char smem[];
  auto s = carve_buffers<T, D>(smem, p.shape.blocks, /*backward=*/true);
  const int items = p.shape.batch * p.shape.heads, blocks = p.shape.blocks;
  const int length = p.shape.tokens / blocks;
  const bool want_dm = p.grad_mixing != nullptr;
  load_mixing(p.mixing, blocks, s.w);
  FragC<T> dm_acc;  // warp w's share of dm (summed over the warps and items at the end)
  wmma::fill_fragment(dm_acc, 0.f);
  // The forward's view of the item (the states pass reads only k and v).
  SequenceBlockLinearForward f;
  f.shape = p.shape, f.k = p.k, f.v = p.v;
  TileRows<T, D> k_rows, v_rows, q_rows, go_rows;
  auto first_keys = [&](int item, int j) {
    const Span span{item / p.shape.heads, item % p.shape.heads, j * length, (j + 1) * length};
    issue_rows<T, D>(p.k, span, span.begin, k_rows);
    issue_rows<T, D>(p.v, span, span.begin, v_rows);
  };
  auto first_queries = [&](int b, int h, int i) {
    const Span span{b, h, i * length, (i + 1) * length};
    issue_rows<T, D>(p.q, span, span.begin, q_rows);
    issue_rows<T, D>(p.grad_out, span, span.begin, go_rows);
  };
  if (blockIdx.x < items) first_keys(blockIdx.x, 0);
  for (int item = blockIdx.x; item < items; item += gridDim.x) {
    const int b = item / p.shape.heads, h = item % p.shape.heads;
    float* grad_mixed = p.scratch + static_cast<size_t>(item) * blocks * S::state_floats;
    item_states<T, D>(f, b, h, s, k_rows, v_rows, [&] { first_queries(b, h, 0); });

    // Query tiles per block i, against S'_i; dS'_i and dz'_i to the scratch.
    for (int i = 0; i < blocks; ++i) {
      __syncthreads();
      mix_tiles<T, D>(s.states, s.zs, s.w + i * blocks, 1, blocks, s.mixed, s.mz);
      FragC<T> acc[L::frags_per_warp];
#pragma unroll
      for (int u = 0; u < L::frags_per_warp; ++u) wmma::fill_fragment(acc[u], 0.f);
      float dz = 0.f;
      const Span span{b, h, i * length, (i + 1) * length};
      query_tiles<T, D>(p.q, p.grad_out, span, p.shape.tokens, p.shape.heads, s.mixed, s.mz,
                        q_rows, go_rows, s.t, static_cast<T*>(p.grad_q), acc, dz, [&] {
                          if (i + 1 < blocks) first_queries(b, h, i + 1);
                        });
      float* out = grad_mixed + i * S::state_floats;
      __syncthreads();
      write_state<T, D>(acc, out, /*atomic=*/false, out);
      column_sums<D>(dz, s.scratch, out + D * D);
    }
    first_keys(item, 0);  // in flight across the mixing back
    __syncthreads();      // the scratch writes are visible to the whole CTA

    // dm and dS, one chunk of the D x D part at a time; the normalizer column on its own.
    // Each chunk's dS' values are loaded (from L2, mostly) while the previous chunk is worked.
    static_assert((D * D / S::kChunk) % 2 == 0, "chunks come in pairs");
    ChunkValues<D, S::kPerThread> even, odd;
    even.load(grad_mixed, 0, blocks, S::state_floats);
    for (int e0 = 0; e0 < D * D; e0 += 2 * S::kChunk) {
      odd.load(grad_mixed, e0 + S::kChunk, blocks, S::state_floats);
      chunk_products<T, D>(even, e0, blocks, s, dm_acc, want_dm);
      if (e0 + 2 * S::kChunk < D * D) {
        even.load(grad_mixed, e0 + 2 * S::kChunk, blocks, S::state_floats);
      }
      chunk_products<T, D>(odd, e0 + S::kChunk, blocks, s, dm_acc, want_dm);
    }
    {
      // dm[j][i] += z_j . dz'_i; dz_j = sum_i m_ij dz'_i (thread (j, d) pairs).
      const int pairs = blocks * blocks;
      if (want_dm) {
        for (int pair = threadIdx.x; pair < pairs; pair += kThreads) {
          const int j = pair / blocks, i = pair % blocks;
          float sum = 0.f;
          for (int d = 0; d < D; ++d)
            sum += s.zs[j * D + d] * grad_mixed[i * S::state_floats + D * D + d];
          s.scratch[pair] = sum;
        }
      }
      __syncthreads();
      if (want_dm) {
        for (int pair = threadIdx.x; pair < pairs; pair += kThreads) {
          atomicAdd(p.grad_mixing + (pair % blocks) * blocks + pair / blocks, s.scratch[pair]);
        }
      }
      for (int e = threadIdx.x; e < blocks * D; e += kThreads) {
        const int j = e / D, d = e % D;
        float sum = 0.f;
        for (int i = 0; i < blocks; ++i)
          sum += s.w[i * blocks + j] * grad_mixed[i * S::state_floats + D * D + d];
        s.zs[e] = sum;  // every thread read z_j above, before the barrier
      }
      __syncthreads();
    }

    // Key tiles per block j, against dS_j.
    for (int j = 0; j < blocks; ++j) {
      const Span span{b, h, j * length, (j + 1) * length};
      key_tiles<T, D>(p.k, p.v, span, p.shape.tokens, p.shape.heads,
                      s.states + j * S::tile_stride, s.zs + j * D, k_rows, v_rows, s.t,
                      static_cast<T*>(p.grad_k), static_cast<T*>(p.grad_v), [&] {
                        if (j + 1 < blocks) {
                          first_keys(item, j + 1);
                        } else if (item + gridDim.x < items) {
                          first_keys(item + gridDim.x, 0);
                        }
                      });
    }
    __syncthreads();
  }
  if (want_dm) {
    // Sum the eight warps' fragments (dm[j][i], row j) and add them to the gradient once.
    const int warp = threadIdx.x / 32;
    wmma::store_matrix_sync(s.staging + warp * 256, dm_acc, 16, wmma::mem_row_major);
    __syncthreads();
    const int j = threadIdx.x / 16, i = threadIdx.x % 16;
    if (j < blocks && i < blocks) {
      float sum = 0.f;
      for (int w = 0; w < 8; ++w) sum += s.staging[w * 256 + threadIdx.x];
      atomicAdd(p.grad_mixing + i * blocks + j, sum);
    }
  }
}

template <typename Kernel>
cudaError_t opt_in(Kernel kernel, size_t bytes) {
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                              static_cast<int>(bytes));
}

int max_smem_per_block() {
  static const int bytes = [] {
    int device = 0, value = 0;
    cudaGetDevice(&device);
    cudaDeviceGetAttribute(&value, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
    return value;
  }();
  return bytes;
}

template <typename T, int D>
struct SequenceForward {
  static cudaError_t run(const SequenceBlockLinearForward& a, cudaStream_t stream) {
    const size_t bytes = SeqSmem<T, D>::forward(a.shape.blocks);
    const cudaError_t err = opt_in(sequence_forward_kernel<T, D>, bytes);
    if (err != cudaSuccess) return err;
    const int items = a.shape.batch * a.shape.heads;
    const int grid = items < multiprocessors() ? items : multiprocessors();
    sequence_forward_kernel<T, D><<<grid, kThreads, bytes, stream>>>(a);
    return cudaGetLastError();
  }
};

template <typename T, int D>
struct SequenceBackward {
  static cudaError_t run(const SequenceBlockLinearBackward& a, cudaStream_t stream) {
    const size_t bytes = SeqSmem<T, D>::backward(a.shape.blocks);
    cudaError_t err = opt_in(sequence_backward_kernel<T, D>, bytes);
    if (err != cudaSuccess) return err;
    if (a.grad_mixing != nullptr) {
      const size_t floats = static_cast<size_t>(a.shape.blocks) * a.shape.blocks;
      if ((err = cudaMemsetAsync(a.grad_mixing, 0, floats * 4, stream)) != cudaSuccess) return err;
    }
    const int items = a.shape.batch * a.shape.heads;
    const int grid = items < multiprocessors() ? items : multiprocessors();
    sequence_backward_kernel<T, D><<<grid, kThreads, bytes, stream>>>(a);
    return cudaGetLastError();
  }
};

template <typename Args, template <typename, int> class Pass>
Launcher<Args> sequence_launcher(DType dtype, int head_dim) {
  auto by_dim = [&](auto tag) -> Launcher<Args> {
    using T = decltype(tag);
    if (head_dim == 32) return &Pass<T, 32>::run;
    if (head_dim == 64) return &Pass<T, 64>::run;
    return nullptr;
  };
  if (dtype == DType::bf16) return by_dim(__nv_bfloat16{});
  if (dtype == DType::f16) return by_dim(__half{});
  return nullptr;
}

template <int D>
size_t backward_bytes(DType dtype, int blocks) {
  return dtype == DType::f16 ? SeqSmem<__half, D>::backward(blocks)
                             : SeqSmem<__nv_bfloat16, D>::backward(blocks);
}

}  // namespace

bool sequence_block_linear_supported(const BlockLinearShape& s, DType dtype) {
  const bool type_ok = dtype == DType::bf16 || dtype == DType::f16;
  const bool dim_ok = s.head_dim == 32 || s.head_dim == 64;
  if (!type_ok || !dim_ok || s.batch <= 0 || s.heads <= 0 || s.tokens <= 0 || s.blocks < 1 ||
      s.blocks > kMaxBlocks || s.tokens % s.blocks != 0) {
    return false;
  }
  const size_t bytes = s.head_dim == 32 ? backward_bytes<32>(dtype, s.blocks)
                                        : backward_bytes<64>(dtype, s.blocks);
  return bytes <= static_cast<size_t>(max_smem_per_block());
}

size_t sequence_block_linear_scratch_floats(const BlockLinearShape& s) {
  return static_cast<size_t>(s.batch) * s.heads * s.blocks *
         (static_cast<size_t>(s.head_dim) * s.head_dim + s.head_dim);
}

cudaError_t sequence_block_linear_forward(const SequenceBlockLinearForward& args,
                                          cudaStream_t stream) {
  if (!sequence_block_linear_supported(args.shape, args.dtype)) return cudaErrorInvalidValue;
  if (args.mixing == nullptr && args.shape.blocks != 1) return cudaErrorInvalidValue;
  auto run = sequence_launcher<SequenceBlockLinearForward, SequenceForward>(args.dtype,
                                                                            args.shape.head_dim);
  return run != nullptr ? run(args, stream) : cudaErrorInvalidValue;
}

cudaError_t sequence_block_linear_backward(const SequenceBlockLinearBackward& args,
                                           cudaStream_t stream) {
  if (!sequence_block_linear_supported(args.shape, args.dtype)) return cudaErrorInvalidValue;
  if (args.mixing == nullptr && args.shape.blocks != 1) return cudaErrorInvalidValue;
  if (args.scratch == nullptr) return cudaErrorInvalidValue;
  auto run = sequence_launcher<SequenceBlockLinearBackward, SequenceBackward>(args.dtype,
                                                                              args.shape.head_dim);
  return run != nullptr ? run(args, stream) : cudaErrorInvalidValue;
}

}  // namespace mhla_kernels
