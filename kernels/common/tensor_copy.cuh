#pragma once
// Tensor copies (TMA) into shared memory, completing on an mbarrier: one thread starts a
// whole tile (tensor_map.h says how the tile lands), the others wait on the barrier's phase.
#include <cuda.h>

#include <cstdint>

namespace mhla_kernels {
namespace tensor_copy {

__device__ __forceinline__ uint32_t smem(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// A barrier that completes once its one arrival (arrive_expecting) and the bytes it expects have
// come in. Initialized by one thread, then fenced and published with a CTA barrier.
__device__ __forceinline__ void init(uint64_t* bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(smem(bar)) : "memory");
}
// A barrier that completes once `arrivals` plain arrivals (arrive) have come in: a consumer's
// release of a buffer to the thread that refills it.
__device__ __forceinline__ void init(uint64_t* bar, uint32_t arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem(bar)), "r"(arrivals)
               : "memory");
}
__device__ __forceinline__ void arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem(bar)) : "memory");
}
__device__ __forceinline__ void fence_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\nfence.proxy.async.shared::cta;\n" ::
                   : "memory");
}
// The arrival, announcing `bytes` of copies that will complete on the barrier.
__device__ __forceinline__ void arrive_expecting(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem(bar)),
               "r"(bytes)
               : "memory");
}
// Waits until the barrier's phase with parity `parity` has completed.
__device__ __forceinline__ void wait(uint64_t* bar, uint32_t parity) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(smem(bar)), "r"(parity)
        : "memory");
  } while (!done);
}

// A box of a token-major map (encode_token_rows_map) from (token, head, batch).
__device__ __forceinline__ void copy_token_rows(void* dst, const CUtensorMap* map, int token,
                                                int head, int batch, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.5d.shared::cluster.global.mbarrier::complete_tx::bytes "
      "[%0], [%1, {%2, %3, %4, %5, %6}], [%7];\n" ::"r"(smem(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(0), "r"(token), "r"(0), "r"(head), "r"(batch),
      "r"(smem(bar))
      : "memory");
}

// A box of a swizzled token-major map (encode_swizzled_token_view_map) from (token, head, batch).
__device__ __forceinline__ void copy_swizzled_token_rows(void* dst, const CUtensorMap* map,
                                                         int token, int head, int batch,
                                                         uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes "
      "[%0], [%1, {%2, %3, %4, %5}], [%6];\n" ::"r"(smem(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(0), "r"(token), "r"(head), "r"(batch),
      "r"(smem(bar))
      : "memory");
}

// The other direction: a box of a swizzled token-major map from shared memory at `src` to
// (token, head, batch), as one bulk group of the calling thread (rows past the map's end are not
// written). The writes of every thread that filled `src` must be fenced for the async proxy
// (fence_for_copy_engine) and ordered before this call.
__device__ __forceinline__ void store_swizzled_token_rows(const CUtensorMap* map, const void* src,
                                                          int token, int head, int batch) {
  asm volatile(
      "cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%1, %2, %3, %4}], [%5];\n"
      "cp.async.bulk.commit_group;\n" ::"l"(reinterpret_cast<uint64_t>(map)),
      "r"(0), "r"(token), "r"(head), "r"(batch), "r"(smem(src))
      : "memory");
}
// Makes this thread's earlier shared-memory writes visible to the copy engine.
__device__ __forceinline__ void fence_for_copy_engine() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// Waits until the calling thread's stores have read their shared memory (it may be rewritten).
__device__ __forceinline__ void wait_stores_read() {
  asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
}
// Waits until the calling thread's stores are complete.
__device__ __forceinline__ void wait_stores_done() {
  asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
}

// A box of a matrix map (encode_matrix_rows_map) from row `row`.
__device__ __forceinline__ void copy_matrix_rows(void* dst, const CUtensorMap* map, int row,
                                                 uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes "
      "[%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(smem(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(0), "r"(row), "r"(0), "r"(smem(bar))
      : "memory");
}

// `bytes` contiguous bytes (a multiple of 16, both addresses 16-byte aligned).
__device__ __forceinline__ void copy_bytes(void* dst, const void* src, uint32_t bytes,
                                           uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::
          "r"(smem(dst)),
      "l"(reinterpret_cast<uint64_t>(src)), "r"(bytes), "r"(smem(bar))
      : "memory");
}

}  // namespace tensor_copy
}  // namespace mhla_kernels
