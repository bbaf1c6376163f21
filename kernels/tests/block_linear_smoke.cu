// Runs the block-linear kernels (forward and backward, MHLA and linear) on small odd shapes with
// plain CUDA, for compute-sanitizer (no LibTorch, so the sanitizer run takes seconds):
//   compute-sanitizer --tool memcheck build-gpu/kernels/block_linear_smoke
// Exits nonzero on a CUDA error or a non-finite result; 0 with a message when there is no GPU.
#include <cuda_bf16.h>

#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "mhla/block_linear_attention.h"

using namespace mhla_kernels;

namespace {

#define CHECK_CUDA(call)                                                                 \
  do {                                                                                   \
    cudaError_t err_ = (call);                                                           \
    if (err_ != cudaSuccess) {                                                           \
      std::fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(err_)); \
      std::exit(1);                                                                      \
    }                                                                                    \
  } while (0)

template <typename T>
T* upload(const std::vector<float>& host) {
  std::vector<T> converted(host.size());
  for (size_t i = 0; i < host.size(); ++i) converted[i] = T(host[i]);
  T* device = nullptr;
  CHECK_CUDA(cudaMalloc(&device, converted.size() * sizeof(T)));
  CHECK_CUDA(
      cudaMemcpy(device, converted.data(), converted.size() * sizeof(T), cudaMemcpyHostToDevice));
  return device;
}

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
  std::vector<float> mixing_host(static_cast<size_t>(blocks) * blocks, 1.0f / blocks);
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
  for (void* p :
       {(void*)q, (void*)k, (void*)v, (void*)grad_out, (void*)mixing, (void*)states, (void*)mixed,
        (void*)grad_mixed, (void*)grad_states, (void*)grad_mixing, out, dq, dk, dv}) {
    cudaFree(p);
  }
  return ok;
}

}  // namespace

int main() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("no CUDA device: nothing to run\n");
    return 0;
  }
  bool ok = true;
  ok &= run_case<__nv_bfloat16>(DType::bf16, 2, 2, 100, 64, 4, true);   // partial tiles
  ok &= run_case<__nv_bfloat16>(DType::bf16, 1, 2, 1200, 32, 2, true);  // several chunks per block
  ok &= run_case<__nv_bfloat16>(DType::bf16, 3, 1, 12, 128, 1, false);  // linear, N < one tile
  ok &= run_case<float>(DType::f32, 1, 1, 256, 32, 64, true);           // 64 blocks, tf32
  return ok ? 0 : 1;
}
