// The sequential passes of the fused gated DeltaNet: the state carried from chunk to chunk
// (forward) and its gradient carried back (backward). One CTA per (32 value columns, batch x
// head) walks the chunks: its [D, 32] slice of the state stays in shared memory in fp32, with an
// element-type copy as the tensor-core operand; each chunk is two (forward) or two fused
// (backward) products against tiles the parallel passes prepared.
//   forward:  store S_i;  u = U0 - W S_i;  S_{i+1} = exp(G_C) S_i + K~^T u
//   backward: store dS_{i+1};  du = du_local + K~ dS_{i+1};
//             dS_i = exp(G_C) dS_{i+1} + [Q~ ; W]^T [dO' ; -du]
// with K~ = exp(G_C - G) . K, Q~ = exp(G) . Q and dO' = scale dO (the output's scale once).
#include "gated_delta/chunk_passes.h"
#include "gated_delta/chunk_tiles.cuh"

namespace mhla_kernels {
namespace gated_delta {
namespace {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kSlice = 32;             // value columns per CTA
constexpr int kLdSliceE = kSlice + 8;  // element-type rows of the slice
constexpr int kLdSliceF = kSlice + 4;  // fp32 rows of the slice

template <int D>
constexpr size_t forward_bytes() {
  return sizeof(float) * (D * kLdSliceF + kC * kLdSliceF + 2 * kC) +
         2 * (2 * kC * Ld<D>::e + 2 * kC * kLdSliceE + D * kLdSliceE);
}

template <int D>
constexpr size_t backward_bytes() {
  return sizeof(float) * (D * kLdSliceF + kC * kLdSliceF + 3 * kC) +
         2 * (3 * kC * Ld<D>::e + 2 * kC * kLdSliceE + D * kLdSliceE);
}

// The state slice from global fp32 [D, D] (or zeros) into fp32 shared memory.
template <int D>
__device__ void load_state_slice(float* s, const float* src, int col0) {
  for (int e = threadIdx.x; e < D * kSlice; e += kThreads) {
    const int r = e / kSlice, c = e % kSlice;
    s[r * kLdSliceF + c] = src != nullptr ? src[static_cast<int64_t>(r) * D + col0 + c] : 0.f;
  }
}

template <int D>
__device__ void store_state_slice(float* dst, const float* s, int col0) {
  for (int e = threadIdx.x; e < D * kSlice; e += kThreads) {
    const int r = e / kSlice, c = e % kSlice;
    dst[static_cast<int64_t>(r) * D + col0 + c] = s[r * kLdSliceF + c];
  }
}

__device__ __forceinline__ void scale_tile(float* s, int rows, float factor) {
  for (int e = threadIdx.x; e < rows * kSlice; e += kThreads) {
    s[(e / kSlice) * kLdSliceF + e % kSlice] *= factor;
  }
}

template <typename T, int D>
__global__ void __launch_bounds__(kThreads) states_forward_kernel(GatedDeltaArgs p) {
  extern __shared__ __align__(128) unsigned char raw[];
  float* s_f = reinterpret_cast<float*>(raw);  // [D][36]
  float* u_f = s_f + D * kLdSliceF;            // [64][36]
  float* g = u_f + kC * kLdSliceF;             // [64]
  float* to_end = g + kC;                      // [64]
  T* w_s = reinterpret_cast<T*>(to_end + kC);  // [64][D + 8]
  T* kd = w_s + kC * Ld<D>::e;                 // [64][D + 8]: K~
  T* u0_s = kd + kC * Ld<D>::e;                // [64][40]
  T* u_bf = u0_s + kC * kLdSliceE;             // [64][40]
  T* s_bf = u_bf + kC * kLdSliceE;             // [D][40]
  const int bh = blockIdx.y, col0 = blockIdx.x * kSlice;
  const T* k = static_cast<const T*>(p.k);
  const int64_t state0 = static_cast<int64_t>(bh) * D * D;
  load_state_slice<D>(s_f, p.initial_state ? p.initial_state + state0 : nullptr, col0);
  __syncthreads();
  convert_tile<T, D, kSlice, kThreads>(s_bf, kLdSliceE, s_f, kLdSliceF);
  const int chunks = gated_delta_chunks(p.tokens);
  for (int i = 0; i < chunks; ++i) {
    const ChunkPosition at(p, bh, i);
    __syncthreads();  // the previous chunk is done with every tile
    load_gate_sums(g, p, at);
    load_rows<T, D, kThreads>(
        w_s, Ld<D>::e, [&](int r) { return static_cast<const T*>(p.w) + at.tile(r, D); }, kC,
        nullptr);
    load_rows<T, kSlice, kThreads>(
        u0_s, kLdSliceE, [&](int r) { return static_cast<const T*>(p.u0) + at.tile(r, D) + col0; },
        kC, nullptr);
    store_matrix<T, D, kSlice, kThreads>(static_cast<T*>(p.states) + at.state(D) + col0, D, s_bf,
                                         kLdSliceE);
    __syncthreads();
    if (threadIdx.x < kC) to_end[threadIdx.x] = __expf(g[kC - 1] - g[threadIdx.x]);
    gemm<T, kWarps, false, false>(w_s, Ld<D>::e, s_bf, kLdSliceE, u_f, kLdSliceF, kC, kSlice, D,
                                  false);
    __syncthreads();
    load_rows<T, D, kThreads>(
        kd, Ld<D>::e, [&](int r) { return k + at.token(r, D, p.heads, p.tokens); }, at.valid,
        to_end);
    T* u_out = static_cast<T*>(p.u) + at.tile(0, D) + col0;
    for (int e = threadIdx.x; e < kC * kSlice; e += kThreads) {
      const int r = e / kSlice, c = e % kSlice;
      const T x = from_float<T>(to_float(u0_s[r * kLdSliceE + c]) - u_f[r * kLdSliceF + c]);
      u_bf[r * kLdSliceE + c] = x;
      u_out[static_cast<int64_t>(r) * D + c] = x;
    }
    scale_tile(s_f, D, __expf(g[kC - 1]));
    __syncthreads();
    gemm<T, kWarps, true, false>(kd, Ld<D>::e, u_bf, kLdSliceE, s_f, kLdSliceF, D, kSlice, kC,
                                 true);
    __syncthreads();
    convert_tile<T, D, kSlice, kThreads>(s_bf, kLdSliceE, s_f, kLdSliceF);
  }
  __syncthreads();
  store_state_slice<D>(p.final_state + state0, s_f, col0);
}

template <typename T, int D>
__global__ void __launch_bounds__(kThreads) states_backward_kernel(GatedDeltaArgs p) {
  extern __shared__ __align__(128) unsigned char raw[];
  float* ds_f = reinterpret_cast<float*>(raw);  // [D][36]
  float* du_f = ds_f + D * kLdSliceF;           // [64][36]
  float* g = du_f + kC * kLdSliceF;             // [64]
  float* to_end = g + kC;                       // [64]
  float* decay = to_end + kC;                   // [64]: exp(G_r)
  T* qd = reinterpret_cast<T*>(decay + kC);     // [64][D + 8]: Q~, then W right below it
  T* w_s = qd + kC * Ld<D>::e;                  // [64][D + 8]
  T* kd = w_s + kC * Ld<D>::e;                  // [64][D + 8]: K~
  T* do_s = kd + kC * Ld<D>::e;                 // [64][40]: dO', then -du right below it
  T* du_neg = do_s + kC * kLdSliceE;            // [64][40]
  T* ds_bf = du_neg + kC * kLdSliceE;           // [D][40]
  const int bh = blockIdx.y, col0 = blockIdx.x * kSlice;
  const T* q = static_cast<const T*>(p.q);
  const T* k = static_cast<const T*>(p.k);
  const T* d_out = static_cast<const T*>(p.d_out);
  const int64_t state0 = static_cast<int64_t>(bh) * D * D;
  load_state_slice<D>(ds_f, p.final_state_grad ? p.final_state_grad + state0 : nullptr, col0);
  __syncthreads();
  convert_tile<T, D, kSlice, kThreads>(ds_bf, kLdSliceE, ds_f, kLdSliceF);
  const int chunks = gated_delta_chunks(p.tokens);
  for (int i = chunks - 1; i >= 0; --i) {
    const ChunkPosition at(p, bh, i);
    __syncthreads();
    load_gate_sums(g, p, at);
    load_rows<T, D, kThreads>(
        w_s, Ld<D>::e, [&](int r) { return static_cast<const T*>(p.w) + at.tile(r, D); }, kC,
        nullptr);
    load_rows_f32<kSlice, kThreads>(du_f, kLdSliceF, p.du_local + at.tile(0, D) + col0, D);
    load_rows<T, kSlice, kThreads>(
        do_s, kLdSliceE, [&](int r) { return d_out + at.token(r, D, p.heads, p.tokens) + col0; },
        at.valid, nullptr, p.scale);
    store_matrix<T, D, kSlice, kThreads>(static_cast<T*>(p.state_grads) + at.state(D) + col0, D,
                                         ds_bf, kLdSliceE);
    __syncthreads();
    if (threadIdx.x < kC) {
      to_end[threadIdx.x] = __expf(g[kC - 1] - g[threadIdx.x]);
      decay[threadIdx.x] = __expf(g[threadIdx.x]);
    }
    __syncthreads();
    load_rows<T, D, kThreads>(
        kd, Ld<D>::e, [&](int r) { return k + at.token(r, D, p.heads, p.tokens); }, at.valid,
        to_end);
    load_rows<T, D, kThreads>(
        qd, Ld<D>::e, [&](int r) { return q + at.token(r, D, p.heads, p.tokens); }, at.valid,
        decay);
    __syncthreads();
    gemm<T, kWarps, false, false>(kd, Ld<D>::e, ds_bf, kLdSliceE, du_f, kLdSliceF, kC, kSlice, D,
                                  true);
    __syncthreads();
    T* du_out = static_cast<T*>(p.du) + at.tile(0, D) + col0;
    for (int e = threadIdx.x; e < kC * kSlice; e += kThreads) {
      const int r = e / kSlice, c = e % kSlice;
      const float x = du_f[r * kLdSliceF + c];
      du_neg[r * kLdSliceE + c] = from_float<T>(-x);
      du_out[static_cast<int64_t>(r) * D + c] = from_float<T>(x);
    }
    scale_tile(ds_f, D, __expf(g[kC - 1]));
    __syncthreads();
    // [Q~ ; W]^T [dO' ; -du]: the two products as one of depth 128.
    gemm<T, kWarps, true, false>(qd, Ld<D>::e, do_s, kLdSliceE, ds_f, kLdSliceF, D, kSlice, 2 * kC,
                                 true);
    __syncthreads();
    convert_tile<T, D, kSlice, kThreads>(ds_bf, kLdSliceE, ds_f, kLdSliceF);
  }
  __syncthreads();
  if (p.initial_state_grad != nullptr) {
    store_state_slice<D>(p.initial_state_grad + state0, ds_f, col0);
  }
}

template <typename T, int D>
struct StatesForward {
  static cudaError_t launch(const GatedDeltaArgs& a, cudaStream_t stream) {
    constexpr size_t bytes = forward_bytes<D>();
    if (cudaError_t err = allow_shared(states_forward_kernel<T, D>, bytes); err != cudaSuccess) {
      return err;
    }
    const dim3 grid(D / kSlice, a.batch * a.heads);
    states_forward_kernel<T, D><<<grid, kThreads, bytes, stream>>>(a);
    return cudaGetLastError();
  }
};

template <typename T, int D>
struct StatesBackward {
  static cudaError_t launch(const GatedDeltaArgs& a, cudaStream_t stream) {
    constexpr size_t bytes = backward_bytes<D>();
    if (cudaError_t err = allow_shared(states_backward_kernel<T, D>, bytes); err != cudaSuccess) {
      return err;
    }
    const dim3 grid(D / kSlice, a.batch * a.heads);
    states_backward_kernel<T, D><<<grid, kThreads, bytes, stream>>>(a);
    return cudaGetLastError();
  }
};

}  // namespace

cudaError_t run_states_forward(const GatedDeltaArgs& a, cudaStream_t stream) {
  return dispatch<StatesForward>(a, stream);
}

cudaError_t run_states_backward(const GatedDeltaArgs& a, cudaStream_t stream) {
  return dispatch<StatesBackward>(a, stream);
}

}  // namespace gated_delta
}  // namespace mhla_kernels
