// Block linear attention with one 16-CTA cluster per (batch, head): cluster_block_linear.h says
// what each pass computes. The tile loops (feature map while loading, WMMA products, feature
// backward) are those of the state kernels (block_linear_attention.cu); what is new here is the
// state exchange through distributed shared memory.
//
// One forward CTA:  states (S_c, fp32) -> cluster sync -> mix slice into every CTA's tile ->
//                   cluster sync -> outputs from its own mixed tile.
// One backward CTA: states -> sync -> mix -> sync -> query tiles (dq, dS'_c) -> sync ->
//                   mix dS' back + the dm products of its slice -> sync -> dm rows reduced over
//                   the cluster -> key tiles (dk, dv) -> final cluster wait (peers may still read
//                   this CTA's dm products until then).
#include <cooperative_groups.h>

#include <cstdlib>

#include "common/packed_access.cuh"
#include "mhla/cluster_block_linear.h"
#include "mhla/token_passes.cuh"

namespace mhla_kernels {
namespace {

using namespace tiles;
namespace cg = cooperative_groups;

constexpr int kC = kAttentionClusterSize;

// The token span of this CTA in the cluster's current (batch, head) item: rank c's 1/16.
__device__ __forceinline__ Span span_of(const BlockLinearShape& s, int rank, int item) {
  const int length = s.tokens / kC;
  return {item / s.heads, item % s.heads, rank * length, (rank + 1) * length};
}

// w[t * kC + c]: the weight of CTA c's state in CTA t's mixed state.
__device__ __forceinline__ void load_weights(const float* mixing, int blocks, float* w) {
  const int per = kC / blocks;
  for (int e = threadIdx.x; e < kC * kC; e += kThreads) {
    const int t = e / kC, c = e % kC;
    w[e] = mixing != nullptr ? mixing[(t / per) * blocks + c / per] : 1.f;
  }
}

// Shared-memory layout of one head dimension for these kernels.
template <typename T, int D>
struct Smem {
  using L = Layout<T, D>;
  using E = typename Mma<T>::elem;
  static constexpr int state_floats = D * D + D;               // S (or dS') then z, fp32
  static constexpr int groups = state_floats / 4;              // float4 groups of a state
  static constexpr int slice = (groups + kC - 1) / kC;         // groups per CTA in the mix
  static constexpr size_t tile_bytes = align128(kTile * L::lde * sizeof(E));
  static constexpr size_t ftile_bytes = align128(kTile * L::ldf * 4);
  static constexpr size_t state_bytes = align128(state_floats * 4);
  static constexpr size_t big_bytes = state_bytes > ftile_bytes ? state_bytes : ftile_bytes;
  static constexpr size_t mixed_bytes = align128(D * L::lde * sizeof(E)) + align128(D * 4);
  static constexpr size_t small_bytes =
      align128(kC * kC * 4) * 2 + 3 * align128(kTile * 4) + align128(kThreads * 4);
  // Forward: own state (later the numerator tile) | mixed tile + z | k (later q) and v tiles.
  static constexpr size_t forward = big_bytes + mixed_bytes + 2 * tile_bytes + small_bytes;
  // Backward: own state | mixed tile + z (later dS + dz) | k, v tiles | q, dnum tiles (later the
  // dv tile) | numerator / dphi tile (dS' between the query and key tiles).
  static constexpr size_t backward =
      state_bytes + mixed_bytes + 4 * tile_bytes + big_bytes + small_bytes;
  // The backward mix stages dS' and S slices of all sixteen CTAs over the four token tiles.
  static_assert(2 * kC * slice * 16 <= 4 * tile_bytes, "mix staging does not fit");
  static_assert(ftile_bytes <= 2 * tile_bytes, "dv tile does not fit the q tiles");
};

// This CTA's slice of the mix: for every CTA t of the cluster, sum_c w(t, c) X_c (Transposed:
// w(c, t)) over the float4 groups of the slice, from the fp32 states X_c at `state` in each CTA,
// into t's tensor-core tile (D x lde) and its normalizer column `z`. With `stage`, the groups read
// (X_c) and Y_c from `other` are also kept in this CTA's shared memory as stage[c][slot] and
// stage[kC + c][slot] (zeros past the state) for the mixing gradient.
template <typename T, int D, bool Transposed>
__device__ void mix_slice(const cg::cluster_group& cl, int rank, const float* state,
                          const float* w, typename Mma<T>::elem* tile, float* z,
                          const float* other = nullptr, float4* stage = nullptr) {
  using S = Smem<T, D>;
  using L = Layout<T, D>;
  using E = typename Mma<T>::elem;
  const int slot = threadIdx.x, g = rank * S::slice + slot;
  if (slot >= S::slice) return;
  if (g >= S::groups) {
    if (stage != nullptr) {
      for (int c = 0; c < 2 * kC; ++c) stage[c * S::slice + slot] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
    return;
  }
  float4 x[kC];
#pragma unroll
  for (int c = 0; c < kC; ++c)
    x[c] = *reinterpret_cast<const float4*>(cl.map_shared_rank(state, c) + 4 * g);
  if (stage != nullptr) {
#pragma unroll
    for (int c = 0; c < kC; ++c) {
      stage[c * S::slice + slot] = x[c];
      stage[(kC + c) * S::slice + slot] =
          *reinterpret_cast<const float4*>(cl.map_shared_rank(other, c) + 4 * g);
    }
  }
  const int e = 4 * g;
#pragma unroll 4
  for (int t = 0; t < kC; ++t) {
    float sum[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int c = 0; c < kC; ++c) {
      const float weight = Transposed ? w[c * kC + t] : w[t * kC + c];
      sum[0] += weight * x[c].x, sum[1] += weight * x[c].y;
      sum[2] += weight * x[c].z, sum[3] += weight * x[c].w;
    }
    if (e < D * D) {
      store_pack<E, 4>(cl.map_shared_rank(tile, t) + (e / D) * L::lde + e % D, sum);
    } else {
      *reinterpret_cast<float4*>(cl.map_shared_rank(z, t) + (e - D * D)) =
          make_float4(sum[0], sum[1], sum[2], sum[3]);
    }
  }
}

template <typename T, int D>
__global__ void __launch_bounds__(kThreads, 2)  // 128 registers: the mix holds 64 floats
    cluster_forward_kernel(ClusterBlockLinearForward p) {
  using S = Smem<T, D>;
  using L = Layout<T, D>;
  using E = typename Mma<T>::elem;
  extern __shared__ __align__(128) unsigned char smem[];
  Carver carve{smem};
  float* state = carve.take<float>(S::big_bytes);  // later the numerator tile
  E* mixed = carve.take<E>(D * L::lde * sizeof(E));
  float* z = carve.take<float>(D * 4);
  E* kf = carve.take<E>(S::tile_bytes);  // later q's features
  E* vt = carve.take<E>(S::tile_bytes);
  float* w = carve.take<float>(kC * kC * 4);
  float* denominator = carve.take<float>(kTile * 4);
  float* scratch = carve.take<float>(kThreads * 4);

  const cg::cluster_group cl = cg::this_cluster();
  const int rank = static_cast<int>(cl.block_rank());
  load_weights(p.mixing, p.shape.blocks, w);
  // Persistent clusters walk the (batch, head) items. The cluster barriers of one item also
  // order the next: a peer writes this CTA's mixed tile only after the next item's first
  // barrier, which this CTA reaches when its outputs are done.
  const int items = p.shape.batch * p.shape.heads;
  TileRows<T, D> k_rows, v_rows, q_rows;
  if (blockIdx.y < items) {
    const Span first = span_of(p.shape, rank, blockIdx.y);
    issue_rows<T, D>(p.k, first, first.begin, k_rows);
    issue_rows<T, D>(p.v, first, first.begin, v_rows);
  }
  for (int item = blockIdx.y; item < items; item += gridDim.y) {
    const Span span = span_of(p.shape, rank, item);
    const Span next = span_of(p.shape, rank, item + gridDim.y);
    const bool has_next = item + gridDim.y < items;
    // The next item's first k/v tile flies across the rest of this item.
    span_state<T, D>(p.k, p.v, span, k_rows, v_rows, kf, vt, state, scratch, [&] {
      if (has_next) {
        issue_rows<T, D>(p.k, next, next.begin, k_rows);
        issue_rows<T, D>(p.v, next, next.begin, v_rows);
      }
    });
    cl.sync();
    mix_slice<T, D, false>(cl, rank, state, w, mixed, z);
    issue_rows<T, D>(p.q, span, span.begin, q_rows);  // in flight across the barrier
    cl.sync();  // every CTA's mixed tile is complete; no peer reads `state` any more
    output_tiles<T, D>(p.q, span, p.shape.tokens, p.shape.heads, mixed, z, q_rows, kf, state,
                       denominator, static_cast<T*>(p.out), [] {});
  }
}

// dm products of this CTA's slice: part[i * kC + j] = sum over the slice of dS'_i * S_j, from
// stage (dS' groups in rows 0..kC-1, S groups in rows kC..2kC-1). Thread t takes a 2 x 2 block of
// pairs and a quarter of the slots; quarters are summed over neighbouring lanes.
template <int Slice>
__device__ void slice_pair_products(const float4* stage, float* part) {
  const int quarter = threadIdx.x % 4, block = threadIdx.x / 4;  // 64 blocks of 2 x 2 pairs
  const int i0 = (block / 8) * 2, j0 = (block % 8) * 2;
  float sum[2][2] = {{0.f, 0.f}, {0.f, 0.f}};
  for (int s = quarter; s < Slice; s += 4) {
    float4 x[2], y[2];
#pragma unroll
    for (int a = 0; a < 2; ++a) {
      x[a] = stage[(i0 + a) * Slice + s];
      y[a] = stage[(kC + j0 + a) * Slice + s];
    }
#pragma unroll
    for (int a = 0; a < 2; ++a) {
#pragma unroll
      for (int b = 0; b < 2; ++b)
        sum[a][b] += x[a].x * y[b].x + x[a].y * y[b].y + x[a].z * y[b].z + x[a].w * y[b].w;
    }
  }
#pragma unroll
  for (int a = 0; a < 2; ++a) {
#pragma unroll
    for (int b = 0; b < 2; ++b) {
      float v = sum[a][b];
      v += __shfl_xor_sync(0xffffffffu, v, 1);
      v += __shfl_xor_sync(0xffffffffu, v, 2);
      if (quarter == 0) part[(i0 + a) * kC + j0 + b] = v;
    }
  }
}

template <typename T, int D>
__global__ void __launch_bounds__(kThreads, 2)  // 83 KB of shared memory at D = 64
    cluster_backward_kernel(ClusterBlockLinearBackward p) {
  using S = Smem<T, D>;
  using L = Layout<T, D>;
  using E = typename Mma<T>::elem;
  extern __shared__ __align__(128) unsigned char smem[];
  Carver carve{smem};
  float* state = carve.take<float>(S::state_bytes);
  E* mixed = carve.take<E>(D * L::lde * sizeof(E));  // S'_c, later dS_c
  float* z = carve.take<float>(D * 4);               // z'_c, later dz_c
  GradientTiles<T> t;
  t.kf = carve.take<E>(S::tile_bytes);
  t.vt = carve.take<E>(S::tile_bytes);
  t.qf = carve.take<E>(S::tile_bytes);
  t.dnum = carve.take<E>(S::tile_bytes);
  t.work = carve.take<float>(S::big_bytes);  // numerator, dphi, then dS'_c, then dphi(k)
  t.dv_tile = reinterpret_cast<float*>(t.qf);  // qf, dnum in the key tiles
  float* w = carve.take<float>(kC * kC * 4);
  float* part = carve.take<float>(kC * kC * 4);
  t.inv_rms = carve.take<float>(kTile * 4);
  t.denominator = carve.take<float>(kTile * 4);
  t.dden = carve.take<float>(kTile * 4);
  float* scratch = carve.take<float>(kThreads * 4);
  float4* stage = reinterpret_cast<float4*>(t.kf);  // kf .. dnum while mixing back

  const cg::cluster_group cl = cg::this_cluster();
  const int rank = static_cast<int>(cl.block_rank());
  load_weights(p.mixing, p.shape.blocks, w);
  const int items = p.shape.batch * p.shape.heads;
  TileRows<T, D> k_rows, v_rows, q_rows, go_rows;
  if (blockIdx.y < items) {
    const Span first = span_of(p.shape, rank, blockIdx.y);
    issue_rows<T, D>(p.k, first, first.begin, k_rows);
    issue_rows<T, D>(p.v, first, first.begin, v_rows);
  }
  for (int item = blockIdx.y; item < items; item += gridDim.y) {
    const Span span = span_of(p.shape, rank, item);
    const Span next = span_of(p.shape, rank, item + gridDim.y);
    const bool has_next = item + gridDim.y < items;
    span_state<T, D>(p.k, p.v, span, k_rows, v_rows, t.kf, t.vt, state, scratch, [] {});
    cl.sync();
    mix_slice<T, D, false>(cl, rank, state, w, mixed, z);
    issue_rows<T, D>(p.q, span, span.begin, q_rows);
    issue_rows<T, D>(p.grad_out, span, span.begin, go_rows);
    cl.sync();

    FragC<T> acc[L::frags_per_warp];
#pragma unroll
    for (int u = 0; u < L::frags_per_warp; ++u) wmma::fill_fragment(acc[u], 0.f);
    float dz = 0.f;
    query_tiles<T, D>(p.q, p.grad_out, span, p.shape.tokens, p.shape.heads, mixed, z, q_rows,
                      go_rows, t, static_cast<T*>(p.grad_q), acc, dz, [] {});
    __syncthreads();  // the last dphi tile has been read
    float* grad_mixed = t.work;
    write_state<T, D>(acc, grad_mixed, /*atomic=*/false, grad_mixed);
    column_sums<D>(dz, scratch, grad_mixed + D * D);
    cl.sync();  // dS' complete everywhere; every CTA is done with its mixed tile

    // dS_c = sum_t w(t, c) dS'_t into every CTA's tile; this slice's dm products on the way.
    mix_slice<T, D, true>(cl, rank, grad_mixed, w, mixed, z, state, stage);
    __syncthreads();
    slice_pair_products<S::slice>(stage, part);
    issue_rows<T, D>(p.k, span, span.begin, k_rows);
    issue_rows<T, D>(p.v, span, span.begin, v_rows);
    cl.sync();  // dS tiles and the dm products complete

    // Row `rank` of the cluster's dm products, summed over its CTAs, into the mixing gradient.
    if (p.grad_mixing != nullptr && threadIdx.x < kC) {
      float sum = 0.f;
      for (int c = 0; c < kC; ++c) sum += cl.map_shared_rank(part, c)[rank * kC + threadIdx.x];
      const int per = kC / p.shape.blocks;
      atomicAdd(p.grad_mixing + (rank / per) * p.shape.blocks + threadIdx.x / per, sum);
    }
    // Peers read `part` until they arrive here; this CTA waits for them before it goes on.
    asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
    // The next item's first k/v tile flies across the cluster wait.
    key_tiles<T, D>(p.k, p.v, span, p.shape.tokens, p.shape.heads, mixed, z, k_rows, v_rows, t,
                    static_cast<T*>(p.grad_k), static_cast<T*>(p.grad_v), [&] {
                      if (has_next) {
                        issue_rows<T, D>(p.k, next, next.begin, k_rows);
                        issue_rows<T, D>(p.v, next, next.begin, v_rows);
                      }
                    });
    asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
  }
}

// Opts `kernel` into its shared memory and the non-portable cluster size of 16; each
// instantiation calls this from its own function-local static, so it runs once per kernel.
template <typename Kernel>
cudaError_t configure_clusters(Kernel kernel, size_t smem_bytes) {
  const cudaError_t err = allow_smem(kernel, smem_bytes);
  if (err != cudaSuccess) return err;
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
}

template <typename Kernel>
int max_active_clusters(Kernel kernel, size_t smem_bytes);

// Clusters to launch: as many as the device holds at once (persistent, each walking items), or
// one per item with MHLA_CLUSTER_PERSISTENT=0. Each instantiation keeps its answer in a static.
template <typename Kernel>
int resident_clusters(Kernel kernel, size_t smem_bytes) {
  const char* value = std::getenv("MHLA_CLUSTER_PERSISTENT");
  if (value != nullptr && value[0] == '0') return 1 << 30;
  const int count = max_active_clusters(kernel, smem_bytes);
  return count > 0 ? count : 1 << 30;
}

// Launches `kernel` on (16, clusters) CTAs in clusters of 16.
// A launch of (16, clusters) CTAs in clusters of 16; `attribute` must outlive the launch.
cudaLaunchConfig_t cluster_config(int clusters, size_t smem_bytes, cudaStream_t stream,
                                  cudaLaunchAttribute& attribute) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(kC, clusters);
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = smem_bytes;
  config.stream = stream;
  attribute.id = cudaLaunchAttributeClusterDimension;
  attribute.val.clusterDim.x = kC;
  attribute.val.clusterDim.y = 1;
  attribute.val.clusterDim.z = 1;
  config.attrs = &attribute;
  config.numAttrs = 1;
  return config;
}

template <typename Kernel, typename Args>
cudaError_t launch_clusters(Kernel kernel, size_t smem_bytes, const Args& args, int resident,
                            cudaStream_t stream) {
  const int items = args.shape.batch * args.shape.heads;
  cudaLaunchAttribute attribute;
  const cudaLaunchConfig_t config =
      cluster_config(items < resident ? items : resident, smem_bytes, stream, attribute);
  return cudaLaunchKernelEx(&config, kernel, args);
}

template <typename T, int D>
struct ClusterForward {
  static cudaError_t run(const ClusterBlockLinearForward& a, cudaStream_t stream) {
    constexpr size_t bytes = Smem<T, D>::forward;
    static const cudaError_t configured = configure_clusters(cluster_forward_kernel<T, D>, bytes);
    if (configured != cudaSuccess) return configured;
    static const int resident = resident_clusters(cluster_forward_kernel<T, D>, bytes);
    return launch_clusters(cluster_forward_kernel<T, D>, bytes, a, resident, stream);
  }
};

template <typename T, int D>
struct ClusterBackward {
  static cudaError_t run(const ClusterBlockLinearBackward& a, cudaStream_t stream) {
    constexpr size_t bytes = Smem<T, D>::backward;
    static const cudaError_t configured = configure_clusters(cluster_backward_kernel<T, D>, bytes);
    if (configured != cudaSuccess) return configured;
    static const int resident = resident_clusters(cluster_backward_kernel<T, D>, bytes);
    if (a.grad_mixing != nullptr) {
      const size_t floats = static_cast<size_t>(a.shape.blocks) * a.shape.blocks;
      const cudaError_t err = cudaMemsetAsync(a.grad_mixing, 0, sizeof(float) * floats, stream);
      if (err != cudaSuccess) return err;
    }
    return launch_clusters(cluster_backward_kernel<T, D>, bytes, a, resident, stream);
  }
};

template <typename Args, template <typename, int> class Pass>
Launcher<Args> cluster_launcher(DType dtype, int head_dim) {
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

bool device_has_clusters() {
  static const bool has = [] {
    int device = 0, major = 0, launch = 0;
    if (cudaGetDevice(&device) != cudaSuccess) return false;
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
    cudaDeviceGetAttribute(&launch, cudaDevAttrClusterLaunch, device);
    return major >= 9 && launch != 0;
  }();
  return has;
}

template <typename Kernel>
int max_active_clusters(Kernel kernel, size_t smem_bytes) {
  if (configure_clusters(kernel, smem_bytes) != cudaSuccess) return -1;
  cudaLaunchAttribute attribute;
  const cudaLaunchConfig_t config = cluster_config(1024, smem_bytes, nullptr, attribute);
  int clusters = 0;
  return cudaOccupancyMaxActiveClusters(&clusters, kernel, &config) == cudaSuccess ? clusters : -1;
}

}  // namespace

int cluster_block_linear_max_active_clusters(bool backward) {
  using T = __nv_bfloat16;
  return backward ? max_active_clusters(cluster_backward_kernel<T, 64>, Smem<T, 64>::backward)
                  : max_active_clusters(cluster_forward_kernel<T, 64>, Smem<T, 64>::forward);
}

bool cluster_block_linear_shape_ok(const BlockLinearShape& s, DType dtype) {
  const bool type_ok = dtype == DType::bf16 || dtype == DType::f16;
  const bool dim_ok = s.head_dim == 32 || s.head_dim == 64;
  return type_ok && dim_ok && s.batch > 0 && s.heads > 0 && s.blocks >= 1 &&
         kC % s.blocks == 0 && s.tokens >= kC && s.tokens % kC == 0 &&
         static_cast<int64_t>(s.batch) * s.heads <= 65535;
}

bool cluster_block_linear_supported(const BlockLinearShape& s, DType dtype) {
  return cluster_block_linear_shape_ok(s, dtype) && device_has_clusters();
}

cudaError_t cluster_block_linear_forward(const ClusterBlockLinearForward& args,
                                         cudaStream_t stream) {
  if (!cluster_block_linear_supported(args.shape, args.dtype)) return cudaErrorInvalidValue;
  if (args.mixing == nullptr && args.shape.blocks != 1) return cudaErrorInvalidValue;
  auto run = cluster_launcher<ClusterBlockLinearForward, ClusterForward>(args.dtype,
                                                                          args.shape.head_dim);
  return run != nullptr ? run(args, stream) : cudaErrorInvalidValue;
}

cudaError_t cluster_block_linear_backward(const ClusterBlockLinearBackward& args,
                                          cudaStream_t stream) {
  if (!cluster_block_linear_supported(args.shape, args.dtype)) return cudaErrorInvalidValue;
  if (args.mixing == nullptr && args.shape.blocks != 1) return cudaErrorInvalidValue;
  auto run = cluster_launcher<ClusterBlockLinearBackward, ClusterBackward>(args.dtype,
                                                                            args.shape.head_dim);
  return run != nullptr ? run(args, stream) : cudaErrorInvalidValue;
}

}  // namespace mhla_kernels
