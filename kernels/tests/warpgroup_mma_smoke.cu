// Checks the warpgroup products of kernels/common/warpgroup_mma.cuh against a host computation:
// a 64 x N x K wgmma from core tiles (N = 64, 128), then mma.sync strip products on the same
// accumulators with each operand plain or transposed, as the gated-delta passes chain them.
//   build-gpu/kernels/warpgroup_mma_smoke [--time]
// Exits nonzero on a mismatch or a CUDA error; 0 with a message when there is no GPU.
#include <cuda_bf16.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "common/tensor_copy.cuh"
#include "common/tensor_map.h"
#include "common/warpgroup_mma.cuh"
#include "tests/smoke_util.h"

using namespace mhla_kernels;
using warpgroup::CoreTile;

namespace {

using T = __nv_bfloat16;

std::vector<float> random_values(size_t n, std::mt19937& rng);

// C = A B^T (A [64][K], B [N][K]) by wgmma, then C += A2 B2 by strip products with A2 [64][64]
// (stored transposed when TransA) and B2 [64][N] (stored [N][64] when TransB). All inputs are
// row-major in global memory; C is fp32 [64][N].
template <int N, int K, bool TransA, bool TransB>
__global__ void chain_kernel(const T* a, const T* b, const T* a2, const T* b2, float* c) {
  extern __shared__ __align__(128) unsigned char raw[];
  CoreTile<T, K> as{reinterpret_cast<T*>(raw)};
  CoreTile<T, K> bs{as.p + 64 * K};
  CoreTile<T, 64> a2s{bs.p + N * K};
  using B2Tile = CoreTile<T, TransB ? 64 : N>;
  B2Tile b2s{a2s.p + 64 * 64};
  warpgroup::copy_rows_async<T, 64, K, 128>(as, a, K, 64);
  warpgroup::copy_rows_async<T, N, K, 128>(bs, b, K, N);
  warpgroup::copy_rows_async<T, 64, 64, 128>(a2s, a2, 64, 64);
  if constexpr (TransB) {
    warpgroup::copy_rows_async<T, N, 64, 128>(b2s, b2, 64, N);
  } else {
    warpgroup::copy_rows_async<T, 64, N, 128>(b2s, b2, N, 64);
  }
  asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;\n" ::: "memory");
  warpgroup::fence_shared_for_mma();
  __syncthreads();
  float acc[N / 2];
#pragma unroll
  for (int i = 0; i < N / 2; ++i) acc[i] = 0.f;
  warpgroup::fence();
  warpgroup::product<T, N, K>(acc, as, 0, 0, bs, 0, 0, false);
  warpgroup::wait<0>();
  warpgroup::pin(acc);
  const int strip = 16 * (threadIdx.x / 32);
  warpgroup::strip_product<T, TransA, TransB, N / 16>(acc, 0, a2s, strip, b2s, 0, 0, 64);
#pragma unroll
  for (int i = 0; i < N / 2; ++i) c[warpgroup::acc_row(i) * N + warpgroup::acc_col(i)] = acc[i];
}

// Tensor copies: a token-major box (partly past the sequence) and a matrix box (partly past the
// last row) into shared memory, written back raw; then C = Q K^T (64 x 64 x 128) by wgmma from
// two token-major boxes in the column-blocks layout.
__global__ void tensor_copy_kernel(const __grid_constant__ CUtensorMap tokens,
                                   const __grid_constant__ CUtensorMap matrix, int token0, int head,
                                   int batch, int row0, T* raw_tokens, T* raw_matrix, float* c) {
  extern __shared__ __align__(128) unsigned char raw[];
  __shared__ uint64_t bar;
  T* t_s = reinterpret_cast<T*>(raw);  // [64][128]
  T* m_s = t_s + 64 * 128;             // [64][64]
  T* q_s = m_s + 64 * 64;              // [64][128]
  T* k_s = q_s + 64 * 128;             // [64][128]
  if (threadIdx.x == 0) {
    tensor_copy::init(&bar);
    tensor_copy::fence_init();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    tensor_copy::arrive_expecting(&bar, 2 * (3 * 64 * 128 + 64 * 64));
    tensor_copy::copy_token_rows(t_s, &tokens, token0, head, batch, &bar);
    tensor_copy::copy_matrix_rows(m_s, &matrix, row0, &bar);
    tensor_copy::copy_token_rows(q_s, &tokens, 0, 0, 0, &bar);
    tensor_copy::copy_token_rows(k_s, &tokens, 0, 1, 0, &bar);
  }
  tensor_copy::wait(&bar, 0);
  for (int e = threadIdx.x; e < 64 * 128; e += blockDim.x) raw_tokens[e] = t_s[e];
  for (int e = threadIdx.x; e < 64 * 64; e += blockDim.x) raw_matrix[e] = m_s[e];
  float acc[32];
#pragma unroll
  for (int i = 0; i < 32; ++i) acc[i] = 0.f;
  warpgroup::fence();
  warpgroup::product<T, 64, 128>(acc, CoreTile<T, 128, 64>{q_s}, 0, 0, CoreTile<T, 128, 64>{k_s}, 0,
                                 0, false);
  warpgroup::wait<0>();
  warpgroup::pin(acc);
#pragma unroll
  for (int i = 0; i < 32; ++i) c[warpgroup::acc_row(i) * 64 + warpgroup::acc_col(i)] = acc[i];
}

// Swizzled tiles (SwizzledTile) from a 64-wide swizzled token map: heads 0, 1 and 2 of batch
// `batch`, 128 rows each (rows past the sequence zero); head 0 written back through at(); then
// S = A B^T with both read K-major (64 x 128 x 64, A = head 0's first 64 rows, B = head 1) and
// O = P V with P = bf16(S) from registers and V = head 2 read transposed (64 x 64 x 128): the
// two kinds of product of the resident MHLA kernels.
__global__ void swizzled_kernel(const __grid_constant__ CUtensorMap tokens, int batch, T* placed,
                                float* s_out, float* o_out) {
  extern __shared__ __align__(128) unsigned char raw[];
  __shared__ uint64_t bar;
  const uint32_t address = static_cast<uint32_t>(__cvta_generic_to_shared(raw));
  unsigned char* base = raw + (1024 - address % 1024) % 1024;
  using Tile = warpgroup::SwizzledTile<T, 128>;
  const Tile a{reinterpret_cast<T*>(base)}, b{a.p + 128 * 64}, v{b.p + 128 * 64};
  if (threadIdx.x == 0) {
    tensor_copy::init(&bar);
    tensor_copy::fence_init();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    tensor_copy::arrive_expecting(&bar, 3 * 128 * 64 * 2);
    tensor_copy::copy_swizzled_token_rows(a.p, &tokens, 0, 0, batch, &bar);
    tensor_copy::copy_swizzled_token_rows(b.p, &tokens, 0, 1, batch, &bar);
    tensor_copy::copy_swizzled_token_rows(v.p, &tokens, 0, 2, batch, &bar);
  }
  tensor_copy::wait(&bar, 0);
  for (int e = threadIdx.x; e < 128 * 64; e += blockDim.x) placed[e] = *a.at(e / 64, e % 64);
  float s[64], o[32];
#pragma unroll
  for (int i = 0; i < 32; ++i) o[i] = 0.f;
  warpgroup::pin(o);
  warpgroup::fence();
  warpgroup::product<T, 128, 64>(s, a, 0, 0, b, 0, 0, false);
  warpgroup::wait<0>();
  warpgroup::pin(s);
  unsigned p[8][4];
  warpgroup::to_a_fragments<T>(s, p);
  warpgroup::fence();
  warpgroup::product_register_a<T, 64, 128>(o, p, v, 0, 0, true);
  warpgroup::wait<0>();
  warpgroup::pin(o);
#pragma unroll
  for (int i = 0; i < 64; ++i) s_out[warpgroup::acc_row(i) * 128 + warpgroup::acc_col(i)] = s[i];
#pragma unroll
  for (int i = 0; i < 32; ++i) o_out[warpgroup::acc_row(i) * 64 + warpgroup::acc_col(i)] = o[i];
}

bool check_tensor_copies(std::mt19937& rng) {
  constexpr int B = 2, Tn = 100, H = 3, D = 128, Rows = 300, Cols = 64;
  const auto x = random_values(size_t(B) * Tn * H * D, rng);
  const auto mtx = random_values(size_t(Rows) * Cols, rng);
  T *dx = upload<T>(x), *dm = upload<T>(mtx), *out_t = nullptr, *out_m = nullptr;
  float* dc = nullptr;
  CHECK_CUDA(cudaMalloc(&out_t, 64 * 128 * sizeof(T)));
  CHECK_CUDA(cudaMalloc(&out_m, 64 * 64 * sizeof(T)));
  CHECK_CUDA(cudaMalloc(&dc, 64 * 64 * sizeof(float)));
  CUtensorMap tokens{}, matrix{};
  if (encode_token_rows_map(&tokens, dx, B, Tn, H, D, 64) != cudaSuccess ||
      encode_matrix_rows_map(&matrix, dm, Rows, Cols, 64) != cudaSuccess) {
    std::printf("tensor maps: encoding refused\n");
    return false;
  }
  const int token0 = 64, head = 1, batch = 1, row0 = 256;
  const size_t bytes = 2 * (3 * 64 * 128 + 64 * 64);
  CHECK_CUDA(
      cudaFuncSetAttribute(tensor_copy_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  tensor_copy_kernel<<<1, 128, bytes>>>(tokens, matrix, token0, head, batch, row0, out_t, out_m,
                                        dc);
  CHECK_CUDA(cudaGetLastError());
  std::vector<T> got_t(64 * 128), got_m(64 * 64);
  std::vector<float> got_c(64 * 64);
  CHECK_CUDA(cudaMemcpy(got_t.data(), out_t, got_t.size() * sizeof(T), cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(got_m.data(), out_m, got_m.size() * sizeof(T), cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(got_c.data(), dc, got_c.size() * sizeof(float), cudaMemcpyDeviceToHost));
  int bad = 0;
  for (int r = 0; r < 64; ++r) {
    for (int c = 0; c < 128; ++c) {
      const int t = token0 + r;
      const float want = t < Tn ? x[((size_t(batch) * Tn + t) * H + head) * D + c] : 0.f;
      if (__bfloat162float(got_t[((c / 8) * 64 + r) * 8 + c % 8]) != want) ++bad;
    }
    for (int c = 0; c < 64; ++c) {
      const int row = row0 + r;
      const float want = row < Rows ? mtx[size_t(row) * Cols + c] : 0.f;
      if (__bfloat162float(got_m[((c / 8) * 64 + r) * 8 + c % 8]) != want) ++bad;
    }
  }
  double diff = 0, norm = 0;
  for (int r = 0; r < 64; ++r) {
    for (int s = 0; s < 64; ++s) {
      double sum = 0;
      for (int c = 0; c < D; ++c)
        sum += double(x[(size_t(r) * H + 0) * D + c]) * x[(size_t(s) * H + 1) * D + c];
      diff += (got_c[r * 64 + s] - sum) * (got_c[r * 64 + s] - sum);
      norm += sum * sum;
    }
  }
  const double rel = std::sqrt(diff / norm);
  const bool ok = bad == 0 && rel < 1e-5;
  std::printf(
      "tensor copies: %d misplaced elements; wgmma on copied boxes: relative error %.2e %s\n", bad,
      rel, ok ? "ok" : "MISMATCH");
  for (T* p : {dx, dm, out_t, out_m}) CHECK_CUDA(cudaFree(p));
  CHECK_CUDA(cudaFree(dc));
  return ok;
}

// Many 64 x 128 x 128 products per CTA (four warpgroups), for a throughput figure.
__global__ void __launch_bounds__(512) throughput_kernel(float* sink, int repeats) {
  extern __shared__ __align__(128) unsigned char raw[];
  CoreTile<T, 128> as{reinterpret_cast<T*>(raw)};
  CoreTile<T, 128> bs{as.p + 64 * 128};
  for (int e = threadIdx.x; e < (64 + 128) * 128; e += blockDim.x)
    as.p[e] = __float2bfloat16(0.001f);
  warpgroup::fence_shared_for_mma();
  __syncthreads();
  float acc[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) acc[i] = 0.f;
  for (int r = 0; r < repeats; ++r) {
    warpgroup::fence();
    warpgroup::product<T, 128, 128>(acc, as, 0, 0, bs, 0, 0, true);
    warpgroup::wait<0>();
  }
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < 64; ++i) s += acc[i];
  if (s == 12345.f) sink[0] = s;
}

std::vector<float> random_values(size_t n, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> v(n);
  for (auto& x : v) x = __bfloat162float(__float2bfloat16(normal(rng)));
  return v;
}

template <int N, int K, bool TransA, bool TransB>
bool check_chain(std::mt19937& rng) {
  const auto a = random_values(64 * K, rng), b = random_values(N * K, rng);
  const auto a2 = random_values(64 * 64, rng), b2 = random_values(64 * N, rng);
  // Host: C[r][n] = sum_k a[r][k] b[n][k] + sum_s A2[r][s] B2[s][n].
  std::vector<double> expected(64 * N, 0.0);
  for (int r = 0; r < 64; ++r) {
    for (int n = 0; n < N; ++n) {
      double sum = 0;
      for (int k = 0; k < K; ++k) sum += double(a[r * K + k]) * b[n * K + k];
      for (int s = 0; s < 64; ++s) {
        const double x = TransA ? a2[s * 64 + r] : a2[r * 64 + s];
        const double y = TransB ? b2[n * 64 + s] : b2[s * N + n];
        sum += x * y;
      }
      expected[r * N + n] = sum;
    }
  }
  T *da = upload<T>(a), *db = upload<T>(b), *da2 = upload<T>(a2), *db2 = upload<T>(b2);
  float* dc = nullptr;
  CHECK_CUDA(cudaMalloc(&dc, 64 * N * sizeof(float)));
  const size_t bytes = sizeof(T) * (64 * K + N * K + 64 * 64 + 64 * N);
  auto kernel = chain_kernel<N, K, TransA, TransB>;
  CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  kernel<<<1, 128, bytes>>>(da, db, da2, db2, dc);
  CHECK_CUDA(cudaGetLastError());
  std::vector<float> c(64 * N);
  CHECK_CUDA(cudaMemcpy(c.data(), dc, c.size() * sizeof(float), cudaMemcpyDeviceToHost));
  double diff = 0, norm = 0;
  for (size_t i = 0; i < c.size(); ++i) {
    diff += (c[i] - expected[i]) * (c[i] - expected[i]);
    norm += expected[i] * expected[i];
  }
  const double rel = std::sqrt(diff / norm);
  const bool ok = rel < 1e-5;
  std::printf("wgmma 64x%dx%d + strip (A %s, B %s): relative error %.2e %s\n", N, K,
              TransA ? "transposed" : "plain", TransB ? "transposed" : "plain", rel,
              ok ? "ok" : "MISMATCH");
  for (T* p : {da, db, da2, db2}) CHECK_CUDA(cudaFree(p));
  CHECK_CUDA(cudaFree(dc));
  return ok;
}

}  // namespace

// The swizzled tiles against the host: placement exact, S and O within bf16 rounding.
bool check_swizzled(std::mt19937& rng) {
  constexpr int B = 2, Tn = 100, H = 3, D = 64, batch = 1;
  const auto x = random_values(size_t(B) * Tn * H * D, rng);
  T* dx = upload<T>(x);
  T* placed = nullptr;
  float *ds = nullptr, *dout = nullptr;
  CHECK_CUDA(cudaMalloc(&placed, 128 * 64 * sizeof(T)));
  CHECK_CUDA(cudaMalloc(&ds, 64 * 128 * sizeof(float)));
  CHECK_CUDA(cudaMalloc(&dout, 64 * 64 * sizeof(float)));
  CUtensorMap tokens{};
  const int64_t token_stride = int64_t(H) * D;
  if (encode_swizzled_token_view_map(&tokens, dx, B, Tn, H, token_stride * Tn, token_stride, D,
                                     128) != cudaSuccess) {
    std::printf("swizzled tensor map: encoding refused\n");
    return false;
  }
  const size_t bytes = 3 * 128 * 64 * sizeof(T) + 1024;
  CHECK_CUDA(
      cudaFuncSetAttribute(swizzled_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  swizzled_kernel<<<1, 128, bytes>>>(tokens, batch, placed, ds, dout);
  CHECK_CUDA(cudaGetLastError());
  std::vector<T> got_placed(128 * 64);
  std::vector<float> got_s(64 * 128), got_o(64 * 64);
  CHECK_CUDA(
      cudaMemcpy(got_placed.data(), placed, got_placed.size() * sizeof(T), cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(got_s.data(), ds, got_s.size() * sizeof(float), cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(got_o.data(), dout, got_o.size() * sizeof(float), cudaMemcpyDeviceToHost));
  // x holds bf16-exact values only after rounding: compare against the rounded inputs.
  const auto value = [&](int t, int h, int c) {
    return t < Tn ? __bfloat162float(T(x[((size_t(batch) * Tn + t) * H + h) * D + c])) : 0.f;
  };
  int bad = 0;
  for (int r = 0; r < 128; ++r)
    for (int c = 0; c < 64; ++c)
      if (__bfloat162float(got_placed[r * 64 + c]) != value(r, 0, c)) ++bad;
  double s_diff = 0, s_norm = 0, o_diff = 0, o_norm = 0;
  for (int r = 0; r < 64; ++r) {
    for (int k = 0; k < 128; ++k) {
      double sum = 0;
      for (int c = 0; c < D; ++c) sum += double(value(r, 0, c)) * value(k, 1, c);
      s_diff += (got_s[r * 128 + k] - sum) * (got_s[r * 128 + k] - sum);
      s_norm += sum * sum;
    }
    for (int c = 0; c < D; ++c) {
      double sum = 0;  // P is the device's S rounded to bf16, as the fragments hold it
      for (int k = 0; k < 128; ++k)
        sum += double(__bfloat162float(T(got_s[r * 128 + k]))) * value(k, 2, c);
      o_diff += (got_o[r * 64 + c] - sum) * (got_o[r * 64 + c] - sum);
      o_norm += sum * sum;
    }
  }
  const double s_rel = std::sqrt(s_diff / s_norm), o_rel = std::sqrt(o_diff / o_norm);
  const bool ok = bad == 0 && s_rel < 1e-5 && o_rel < 1e-5;
  std::printf(
      "swizzled tiles: %d misplaced elements; K-major product %.2e, transposed product %.2e %s\n",
      bad, s_rel, o_rel, ok ? "ok" : "MISMATCH");
  CHECK_CUDA(cudaFree(dx));
  CHECK_CUDA(cudaFree(placed));
  CHECK_CUDA(cudaFree(ds));
  CHECK_CUDA(cudaFree(dout));
  return ok;
}

int main(int argc, char** argv) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("no GPU: nothing to check\n");
    return 0;
  }
  std::mt19937 rng(7);
  bool ok = true;
  ok &= check_chain<128, 128, false, false>(rng);
  ok &= check_chain<128, 64, true, false>(rng);
  ok &= check_chain<64, 128, false, true>(rng);
  ok &= check_chain<64, 64, true, true>(rng);
  ok &= check_tensor_copies(rng);
  ok &= check_swizzled(rng);
  if (argc > 1 && std::strcmp(argv[1], "--time") == 0) {
    int sms = 0;
    CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    float* sink = nullptr;
    CHECK_CUDA(cudaMalloc(&sink, sizeof(float)));
    const size_t bytes = (64 + 128) * 128 * sizeof(T);
    const int repeats = 2000;
    cudaEvent_t start, stop;
    CHECK_CUDA(cudaEventCreate(&start));
    CHECK_CUDA(cudaEventCreate(&stop));
    throughput_kernel<<<sms, 512, bytes>>>(sink, 10);
    CHECK_CUDA(cudaEventRecord(start));
    throughput_kernel<<<sms, 512, bytes>>>(sink, repeats);
    CHECK_CUDA(cudaEventRecord(stop));
    CHECK_CUDA(cudaEventSynchronize(stop));
    float ms = 0;
    CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
    const double flops = 2.0 * 64 * 128 * 128 * 4 * repeats * sms;
    std::printf("wgmma 64x128x128 from shared memory, 4 warpgroups per SM: %.0f TFLOP/s\n",
                flops / (ms * 1e-3) / 1e12);
  }
  std::printf(ok ? "all products agree\n" : "MISMATCH\n");
  return ok ? 0 : 1;
}
