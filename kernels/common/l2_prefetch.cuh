#pragma once
// Asking L2 for the bytes a CTA of the next wave will read.
//
// Why: the token passes run one CTA per SM (their tiles fill its shared memory), load their
// tiles, then compute with nothing in flight, so DRAM idles while the products run and every
// CTA starts with a full memory latency. A CTA that asks L2 for the first loads of the CTA
// `ahead` places later in launch order (about one wave on: the CTA that will take over some SM
// when this wave ends) keeps DRAM busy during its own products, and that later CTA finds its
// tiles in L2. cp.async.bulk.prefetch (sm_90) takes no registers and has nothing to wait on.
#include <cuda_runtime.h>

#include <cstdlib>
#include <mutex>

#include "common/device_info.h"

namespace mhla_kernels {

// [p, p + bytes) into L2: p 16-byte aligned, bytes a multiple of 16.
__device__ __forceinline__ void prefetch_l2(const void* p, unsigned bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(p), "r"(bytes) : "memory");
#endif
}

// A long contiguous range (a block state) split into 16 KB requests over `threads` threads,
// `thread` being this one's index among them.
__device__ __forceinline__ void prefetch_l2_range(const void* p, size_t bytes, int thread,
                                                  int threads) {
  constexpr size_t kPiece = 16 * 1024;
  const char* base = static_cast<const char*>(p);
  for (size_t at = static_cast<size_t>(thread) * kPiece; at < bytes;
       at += static_cast<size_t>(threads) * kPiece) {
    const size_t left = bytes - at;
    prefetch_l2(base + at, static_cast<unsigned>(left < kPiece ? left : kPiece));
  }
}

// The linear launch index (x fastest, then y) of the CTA `ahead` places after this one, or -1
// when prefetching is off (ahead <= 0) or no such CTA exists.
__device__ __forceinline__ long long cta_ahead(int ahead) {
  if (ahead <= 0) return -1;
  const long long total = static_cast<long long>(gridDim.x) * gridDim.y;
  const long long next =
      static_cast<long long>(blockIdx.y) * gridDim.x + blockIdx.x + static_cast<long long>(ahead);
  return next < total ? next : -1;
}

// How many waves ahead the token passes prefetch: MHLA_L2_PREFETCH (0 turns it off, for A/B
// runs; N > 0 is N waves), default 1. Read once per process.
inline int l2_prefetch_waves() {
  static const int waves = [] {
    const char* value = std::getenv("MHLA_L2_PREFETCH");
    if (value == nullptr || *value == '\0') return 1;
    char* end = nullptr;
    const long n = std::strtol(value, &end, 10);
    return (*end == '\0' && n >= 0 && n <= 8) ? static_cast<int>(n) : 1;
  }();
  return waves;
}

// The prefetch distance in CTAs for `kernel` launched with `threads` threads and `smem` bytes
// of dynamic shared memory: the resident CTAs of one wave times l2_prefetch_waves(); 0 when off.
template <typename Kernel>
int prefetch_distance(Kernel kernel, int threads, size_t smem) {
  const int waves = l2_prefetch_waves();
  if (waves == 0) return 0;
  int per_sm = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem) !=
      cudaSuccess) {
    cudaGetLastError();  // not fatal: launch without prefetching
    return 0;
  }
  return waves * (per_sm > 0 ? per_sm : 1) * multiprocessors();
}

// prefetch_distance for one kernel, remembered for the last shared-memory size it was asked
// about (the occupancy query costs more than a launch; shapes rarely change between steps).
template <auto Kernel>
int cached_prefetch_distance(int threads, size_t smem) {
  static std::mutex guard;
  static size_t last_smem = ~size_t{0};
  static int last_threads = 0, last_distance = 0;
  std::lock_guard<std::mutex> lock(guard);
  if (smem != last_smem || threads != last_threads) {
    last_distance = prefetch_distance(Kernel, threads, smem);
    last_smem = smem;
    last_threads = threads;
  }
  return last_distance;
}

}  // namespace mhla_kernels
