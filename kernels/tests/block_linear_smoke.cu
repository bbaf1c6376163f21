// Runs the block-linear kernels (forward and backward, MHLA and linear; the state kernels and the
// dense masked ones, which must agree) on small odd shapes with plain CUDA, for compute-sanitizer
// (no LibTorch, so the sanitizer run takes seconds):
//   compute-sanitizer --tool memcheck build-gpu/kernels/block_linear_smoke
// Exits nonzero on a CUDA error or a non-finite result; 0 with a message when there is no GPU.
#include <cuda_bf16.h>

#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "mhla/block_linear_attention.h"
#include "mhla/cluster_block_linear.h"
#include "mhla/dense_block_linear.h"
#include "mhla/resident_block_linear.h"
#include "tests/smoke_util.h"

using namespace mhla_kernels;

namespace {

template <typename T>
bool all_finite(const void* device, size_t count) {
  std::vector<T> host(count);
  CHECK_CUDA(cudaMemcpy(host.data(), device, count * sizeof(T), cudaMemcpyDeviceToHost));
  for (const auto& x : host) {
    if (!std::isfinite(static_cast<float>(x))) return false;
  }
  return true;
}

template <typename T>
std::vector<float> download(const void* device, size_t count) {
  std::vector<T> host(count);
  CHECK_CUDA(cudaMemcpy(host.data(), device, count * sizeof(T), cudaMemcpyDeviceToHost));
  return std::vector<float>(host.begin(), host.end());
}

double relative_difference(const std::vector<float>& a, const std::vector<float>& b) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    norm += double(b[i]) * b[i];
  }
  return std::sqrt(diff / (norm + 1e-30));
}

// The dense kernels on the same inputs; their outputs and gradients against the state kernels'.
template <typename T>
bool dense_agrees(DType dtype, const BlockLinearShape& shape, const TokenTensor& q,
                  const TokenTensor& k, const TokenTensor& v, const float* mixing,
                  const void* grad_out, const void* out, const void* dq, const void* dk,
                  const void* dv, const float* grad_mixing) {
  if (!dense_block_linear_supported(shape, dtype, /*causal=*/false)) return true;
  const size_t count =
      static_cast<size_t>(shape.batch) * shape.tokens * shape.heads * shape.head_dim;
  const size_t rows = static_cast<size_t>(shape.batch) * shape.heads * shape.tokens;
  void *d_out, *d_dq, *d_dk, *d_dv;
  float *den, *grad_den, *d_dm;
  for (void** p : {&d_out, &d_dq, &d_dk, &d_dv}) CHECK_CUDA(cudaMalloc(p, count * sizeof(T)));
  CHECK_CUDA(cudaMalloc(&den, rows * 4));
  CHECK_CUDA(cudaMalloc(&d_dm, static_cast<size_t>(shape.blocks) * shape.blocks * 4));
  DenseBlockLinearForward f;
  f.shape = shape, f.dtype = dtype, f.q = q, f.k = k, f.v = v, f.mixing = mixing;
  f.out = d_out, f.den = den;
  CHECK_CUDA(dense_block_linear_forward(f, nullptr));
  // g = do / (den + eps) and gd = -(do . o) / (den + eps), as the LibTorch binding forms them.
  auto o = download<T>(d_out, count), g_out = download<T>(grad_out, count);
  auto den_host = download<float>(den, rows);
  std::vector<float> g(count), gd(rows);
  const int H = shape.heads, N = shape.tokens, D = shape.head_dim;
  for (int b = 0; b < shape.batch; ++b)
    for (int n = 0; n < N; ++n)
      for (int h = 0; h < H; ++h) {
        const size_t row = (static_cast<size_t>(b) * N + n) * H + h,
                     bh = static_cast<size_t>(b) * H + h;
        const float scale = 1.0f / (den_host[bh * N + n] + 1e-6f);
        float dot = 0;
        for (int d = 0; d < D; ++d) {
          g[row * D + d] = g_out[row * D + d] * scale;
          dot += g_out[row * D + d] * o[row * D + d];
        }
        gd[bh * N + n] = -dot * scale;
      }
  T* g_device = upload<T>(g);
  grad_den = upload<float>(gd);
  DenseBlockLinearBackward bw;
  bw.shape = shape, bw.dtype = dtype, bw.q = q, bw.k = k, bw.v = v;
  const int64_t token_stride = static_cast<int64_t>(H) * D;
  bw.grad_scaled = TokenTensor{g_device, N * token_stride, token_stride, D};
  bw.grad_den = grad_den, bw.mixing = mixing;
  bw.grad_q = d_dq, bw.grad_k = d_dk, bw.grad_v = d_dv;
  bw.grad_mixing = mixing ? d_dm : nullptr;
  CHECK_CUDA(dense_block_linear_backward(bw, nullptr));
  CHECK_CUDA(cudaDeviceSynchronize());
  const double tolerance = dtype == DType::f32 ? 2e-3 : 2e-2;
  bool ok = true;
  auto compare = [&](const char* what, const std::vector<float>& a, const std::vector<float>& b) {
    const double r = relative_difference(a, b);
    std::printf("  dense vs states %s: %.2e\n", what, r);
    ok = ok && r < tolerance;
  };
  compare("out", o, download<T>(out, count));
  compare("dq", download<T>(d_dq, count), download<T>(dq, count));
  compare("dk", download<T>(d_dk, count), download<T>(dk, count));
  compare("dv", download<T>(d_dv, count), download<T>(dv, count));
  if (mixing && shape.blocks > 1) {  // one block: the output does not depend on its weight
    const size_t mm = static_cast<size_t>(shape.blocks) * shape.blocks;
    compare("dmixing", download<float>(d_dm, mm), download<float>(grad_mixing, mm));
  }
  for (void* p :
       {d_out, d_dq, d_dk, d_dv, (void*)den, (void*)grad_den, (void*)d_dm, (void*)g_device})
    cudaFree(p);
  return ok;
}

// The resident kernels on the same inputs, against the state kernels.
template <typename T>
bool resident_agrees(DType dtype, const BlockLinearShape& shape, const TokenTensor& q,
                     const TokenTensor& k, const TokenTensor& v, const float* mixing,
                     const TokenTensor& grad_out, const void* out, const void* dq, const void* dk,
                     const void* dv, const float* grad_mixing) {
  if (!resident_block_linear_supported(shape, dtype)) return true;
  const size_t count =
      static_cast<size_t>(shape.batch) * shape.tokens * shape.heads * shape.head_dim;
  const size_t rows = static_cast<size_t>(shape.batch) * shape.heads * shape.tokens;
  void *r_out, *r_dq, *r_dk, *r_dv;
  float *den, *r_dm;
  for (void** p : {&r_out, &r_dq, &r_dk, &r_dv}) CHECK_CUDA(cudaMalloc(p, count * sizeof(T)));
  CHECK_CUDA(cudaMalloc(&den, rows * 4));
  CHECK_CUDA(cudaMalloc(&r_dm, static_cast<size_t>(shape.blocks) * shape.blocks * 4));
  ResidentBlockLinearForward f;
  f.shape = shape, f.dtype = dtype, f.q = q, f.k = k, f.v = v, f.mixing = mixing;
  f.out = r_out, f.den = den;
  CHECK_CUDA(resident_block_linear_forward(f, nullptr));
  const int64_t token_stride = static_cast<int64_t>(shape.heads) * shape.head_dim;
  ResidentBlockLinearBackward bw;
  bw.shape = shape, bw.dtype = dtype, bw.q = q, bw.k = k, bw.v = v;
  bw.out = TokenTensor{r_out, shape.tokens * token_stride, token_stride, shape.head_dim};
  bw.grad_out = grad_out, bw.den = den, bw.mixing = mixing;
  bw.grad_q = r_dq, bw.grad_k = r_dk, bw.grad_v = r_dv;
  bw.grad_mixing = mixing ? r_dm : nullptr;
  CHECK_CUDA(resident_block_linear_backward(bw, nullptr));
  CHECK_CUDA(cudaDeviceSynchronize());
  bool ok = true;
  auto compare = [&](const char* what, const std::vector<float>& a, const std::vector<float>& b) {
    const double r = relative_difference(a, b);
    std::printf("  resident vs states %s: %.2e\n", what, r);
    ok = ok && r < 2e-2;
  };
  compare("out", download<T>(r_out, count), download<T>(out, count));
  compare("dq", download<T>(r_dq, count), download<T>(dq, count));
  compare("dk", download<T>(r_dk, count), download<T>(dk, count));
  compare("dv", download<T>(r_dv, count), download<T>(dv, count));
  if (mixing && shape.blocks > 1) {  // one block: the output does not depend on its weight
    const size_t mm = static_cast<size_t>(shape.blocks) * shape.blocks;
    compare("dmixing", download<float>(r_dm, mm), download<float>(grad_mixing, mm));
  }
  for (void* p : {r_out, r_dq, r_dk, r_dv, (void*)den, (void*)r_dm}) cudaFree(p);
  return ok;
}

// The cluster kernels on the same inputs, against the state kernels.
template <typename T>
bool cluster_agrees(DType dtype, const BlockLinearShape& shape, const TokenTensor& q,
                    const TokenTensor& k, const TokenTensor& v, const float* mixing,
                    const TokenTensor& grad_out, const void* out, const void* dq, const void* dk,
                    const void* dv, const float* grad_mixing) {
  if (!cluster_block_linear_supported(shape, dtype)) return true;
  const size_t count =
      static_cast<size_t>(shape.batch) * shape.tokens * shape.heads * shape.head_dim;
  void *c_out, *c_dq, *c_dk, *c_dv;
  float* c_dm;
  for (void** p : {&c_out, &c_dq, &c_dk, &c_dv}) CHECK_CUDA(cudaMalloc(p, count * sizeof(T)));
  CHECK_CUDA(cudaMalloc(&c_dm, static_cast<size_t>(shape.blocks) * shape.blocks * 4));
  ClusterBlockLinearForward f;
  f.shape = shape, f.dtype = dtype, f.q = q, f.k = k, f.v = v, f.mixing = mixing;
  f.out = c_out;
  CHECK_CUDA(cluster_block_linear_forward(f, nullptr));
  ClusterBlockLinearBackward bw;
  bw.shape = shape, bw.dtype = dtype, bw.q = q, bw.k = k, bw.v = v, bw.grad_out = grad_out;
  bw.mixing = mixing;
  bw.grad_q = c_dq, bw.grad_k = c_dk, bw.grad_v = c_dv;
  bw.grad_mixing = mixing ? c_dm : nullptr;
  CHECK_CUDA(cluster_block_linear_backward(bw, nullptr));
  CHECK_CUDA(cudaDeviceSynchronize());
  bool ok = true;
  auto compare = [&](const char* what, const std::vector<float>& a, const std::vector<float>& b) {
    const double r = relative_difference(a, b);
    std::printf("  cluster vs states %s: %.2e\n", what, r);
    ok = ok && r < 2e-2;
  };
  compare("out", download<T>(c_out, count), download<T>(out, count));
  compare("dq", download<T>(c_dq, count), download<T>(dq, count));
  compare("dk", download<T>(c_dk, count), download<T>(dk, count));
  compare("dv", download<T>(c_dv, count), download<T>(dv, count));
  if (mixing && shape.blocks > 1) {
    const size_t mm = static_cast<size_t>(shape.blocks) * shape.blocks;
    compare("dmixing", download<float>(c_dm, mm), download<float>(grad_mixing, mm));
  }
  for (void* p : {c_out, c_dq, c_dk, c_dv, (void*)c_dm}) cudaFree(p);
  return ok;
}

template <typename T>
bool run_case(DType dtype, int batch, int heads, int tokens, int dim, int blocks, bool mixes) {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  const size_t count = static_cast<size_t>(batch) * tokens * heads * dim;
  auto random = [&](size_t n) {
    std::vector<float> x(n);
    for (auto& e : x) e = normal(rng);
    return x;
  };
  T* q = upload<T>(random(count));
  T* k = upload<T>(random(count));
  T* v = upload<T>(random(count));
  T* grad_out = upload<T>(random(count));
  // Unequal weights, so that a kernel reading the wrong block's weight disagrees.
  std::vector<float> mixing_host(static_cast<size_t>(blocks) * blocks);
  for (int i = 0; i < blocks; ++i)
    for (int j = 0; j < blocks; ++j)
      mixing_host[static_cast<size_t>(i) * blocks + j] =
          (1.0f + (i * 7 + j * 3) % 5) / (3.0f * blocks);
  float* mixing = mixes ? upload<float>(mixing_host) : nullptr;
  const BlockLinearShape shape{batch, tokens, heads, dim, blocks};
  const size_t floats = block_linear_state_floats(shape);
  float *states, *mixed, *grad_mixed, *grad_states, *grad_mixing;
  void *out, *dq, *dk, *dv;
  CHECK_CUDA(cudaMalloc(&states, floats * 4));
  CHECK_CUDA(cudaMalloc(&mixed, floats * 4));
  CHECK_CUDA(cudaMalloc(&grad_mixed, floats * 4));
  CHECK_CUDA(cudaMalloc(&grad_states, floats * 4));
  CHECK_CUDA(cudaMalloc(&grad_mixing, static_cast<size_t>(blocks) * blocks * 4));
  for (void** p : {&out, &dq, &dk, &dv}) CHECK_CUDA(cudaMalloc(p, count * sizeof(T)));
  const int64_t token_stride = static_cast<int64_t>(heads) * dim;
  auto view = [&](const void* p) {
    return TokenTensor{p, tokens * token_stride, token_stride, dim};
  };

  BlockLinearForward f;
  f.shape = shape;
  f.dtype = dtype;
  f.q = view(q), f.k = view(k), f.v = view(v);
  f.mixing = mixing;
  f.out = out;
  f.states = states;
  f.mixed = mixes ? mixed : states;
  CHECK_CUDA(block_linear_forward(f, nullptr));
  BlockLinearBackward b;
  b.shape = shape;
  b.dtype = dtype;
  b.q = view(q), b.k = view(k), b.v = view(v), b.out = view(out), b.grad_out = view(grad_out);
  b.mixing = mixing;
  b.states = states;
  b.mixed = f.mixed;
  b.grad_q = dq, b.grad_k = dk, b.grad_v = dv;
  b.grad_mixing = mixes ? grad_mixing : nullptr;
  b.grad_mixed = grad_mixed;
  b.grad_states = mixes ? grad_states : grad_mixed;
  CHECK_CUDA(block_linear_backward(b, nullptr));
  CHECK_CUDA(cudaDeviceSynchronize());
  bool ok = all_finite<T>(out, count) && all_finite<T>(dq, count) && all_finite<T>(dk, count) &&
            all_finite<T>(dv, count);
  if (mixes) ok = ok && all_finite<float>(grad_mixing, static_cast<size_t>(blocks) * blocks);
  std::printf("B=%d H=%d N=%d D=%d M=%d mixing=%d: %s\n", batch, heads, tokens, dim, blocks, mixes,
              ok ? "ok" : "NON-FINITE");
  ok = dense_agrees<T>(dtype, shape, view(q), view(k), view(v), mixing, grad_out, out, dq, dk, dv,
                       mixes ? grad_mixing : nullptr) &&
       ok;
  ok = resident_agrees<T>(dtype, shape, view(q), view(k), view(v), mixing, view(grad_out), out, dq,
                          dk, dv, mixes ? grad_mixing : nullptr) &&
       ok;
  ok = cluster_agrees<T>(dtype, shape, view(q), view(k), view(v), mixing, view(grad_out), out, dq,
                         dk, dv, mixes ? grad_mixing : nullptr) &&
       ok;
  for (void* p :
       {(void*)q, (void*)k, (void*)v, (void*)grad_out, (void*)mixing, (void*)states, (void*)mixed,
        (void*)grad_mixed, (void*)grad_states, (void*)grad_mixing, out, dq, dk, dv}) {
    cudaFree(p);
  }
  return ok;
}

// Kernel-only timing of the resident kernels at the vision shape (B = 256, H = 6, N = 256,
// D = 64, M = 16; also linear attention), for profilers: block_linear_smoke --time.
void time_resident() {
  const int B = 256, H = 6, N = 256, D = 64, M = 16;
  const size_t count = static_cast<size_t>(B) * N * H * D;
  std::vector<float> host(count);
  std::mt19937 rng(3);
  std::normal_distribution<float> normal;
  for (auto& x : host) x = normal(rng);
  using T = __nv_bfloat16;
  T *q = upload<T>(host), *k = upload<T>(host), *v = upload<T>(host), *go = upload<T>(host);
  std::vector<float> mixing_host(M * M, 1.0f / M);
  float* mixing = upload<float>(mixing_host);
  void *out, *dq, *dk, *dv;
  float *den, *dm;
  for (void** p : {&out, &dq, &dk, &dv}) CHECK_CUDA(cudaMalloc(p, count * sizeof(T)));
  CHECK_CUDA(cudaMalloc(&den, static_cast<size_t>(B) * H * N * 4));
  CHECK_CUDA(cudaMalloc(&dm, M * M * 4));
  const int64_t ts = static_cast<int64_t>(H) * D;
  auto view = [&](const void* p) { return TokenTensor{p, N * ts, ts, D}; };
  for (int blocks : {M, 1}) {
    const BlockLinearShape shape{B, N, H, D, blocks};
    ResidentBlockLinearForward f;
    f.shape = shape, f.q = view(q), f.k = view(k), f.v = view(v);
    f.mixing = blocks > 1 ? mixing : nullptr, f.out = out, f.den = den;
    ResidentBlockLinearBackward bw;
    bw.shape = shape, bw.q = f.q, bw.k = f.k, bw.v = f.v, bw.out = view(out),
    bw.grad_out = view(go);
    bw.den = den, bw.mixing = f.mixing, bw.grad_mixing = blocks > 1 ? dm : nullptr;
    bw.grad_q = dq, bw.grad_k = dk, bw.grad_v = dv;
    cudaEvent_t start, stop;
    cudaEventCreate(&start);
    cudaEventCreate(&stop);
    const int reps = 20;
    float forward_ms = 0, backward_ms = 0;
    for (int pass = 0; pass < 2; ++pass) {  // the first pass warms up
      cudaEventRecord(start);
      for (int i = 0; i < reps; ++i) CHECK_CUDA(resident_block_linear_forward(f, nullptr));
      cudaEventRecord(stop);
      cudaEventSynchronize(stop);
      cudaEventElapsedTime(&forward_ms, start, stop);
      cudaEventRecord(start);
      for (int i = 0; i < reps; ++i) CHECK_CUDA(resident_block_linear_backward(bw, nullptr));
      cudaEventRecord(stop);
      cudaEventSynchronize(stop);
      cudaEventElapsedTime(&backward_ms, start, stop);
    }
    std::printf("resident M=%d B=%d H=%d N=%d D=%d: forward %.3f ms, backward %.3f ms\n", blocks, B,
                H, N, D, forward_ms / reps, backward_ms / reps);
  }
}

}  // namespace

int main(int argc, char** argv) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("no CUDA device: nothing to run\n");
    return 0;
  }
  if (argc > 1 && std::string(argv[1]) == "--occupancy") {
    std::printf("cluster kernels (bf16, D = 64), clusters of 16 resident at once: forward %d, "
                "backward %d\n",
                cluster_block_linear_max_active_clusters(false),
                cluster_block_linear_max_active_clusters(true));
    return 0;
  }
  if (argc > 1 && std::string(argv[1]) == "--time") {
    time_resident();
    return 0;
  }
  bool ok = true;
  if (argc > 1 && std::string(argv[1]) == "--cluster") {
    // The cluster kernels' cases alone (with the state kernels they are checked against), for a
    // racecheck run that finishes in minutes.
    ok &= run_case<__nv_bfloat16>(DType::bf16, 2, 3, 1024, 64, 16, true);
    ok &= run_case<__half>(DType::f16, 1, 2, 160, 64, 1, false);
    ok &= run_case<__nv_bfloat16>(DType::bf16, 8, 6, 256, 64, 16, true);  // clusters walk items
    return ok ? 0 : 1;
  }
  ok &= run_case<__nv_bfloat16>(DType::bf16, 2, 2, 100, 64, 4, true);   // partial tiles
  ok &= run_case<__nv_bfloat16>(DType::bf16, 1, 2, 1200, 32, 2, true);  // several chunks per block
  ok &= run_case<__nv_bfloat16>(DType::bf16, 3, 1, 12, 128, 1, false);  // linear, N < one tile
  ok &= run_case<float>(DType::f32, 1, 1, 256, 32, 64, true);           // 64 blocks, tf32
  ok &= run_case<__nv_bfloat16>(DType::bf16, 4, 6, 256, 64, 16, true);  // the DeiT/DiT shape
  ok &= run_case<__half>(DType::f16, 2, 3, 512, 32, 8, true);           // resident, fp16, D = 32
  ok &= run_case<__nv_bfloat16>(DType::bf16, 2, 2, 200, 64, 1,
                                false);  // resident linear, partial strip
  ok &= run_case<__nv_bfloat16>(DType::bf16, 1, 2, 48, 64, 1, true);  // resident, M = 1 with mixing
  ok &= run_case<__nv_bfloat16>(DType::bf16, 2, 3, 1024, 64, 16, true);  // cluster, 64-token spans
  ok &= run_case<__half>(DType::f16, 1, 2, 160, 64, 1, false);  // cluster linear, 10-token spans
  ok &= run_case<__nv_bfloat16>(DType::bf16, 32, 6, 256, 64, 16, true);  // clusters walk items
  return ok ? 0 : 1;
}
