#pragma once
// Per-thread asynchronous copies global -> shared (cp.async) for pipelines in which each thread
// reads back only what it copied itself: its own wait_group makes the data visible to it, no
// barrier needed. The bytes in flight sit in shared memory instead of registers, so a thread can
// keep many loads outstanding without giving up occupancy.
namespace mhla_kernels {
namespace async_copy {

// Copies Bytes (4, 8 or 16) from src to dst_shared; zero-fills instead when !valid (src is not
// read then, but must be a valid address expression).
template <int Bytes>
__device__ __forceinline__ void copy(void* dst_shared, const void* src, bool valid) {
  static_assert(Bytes == 4 || Bytes == 8 || Bytes == 16, "cp.async copies 4, 8 or 16 bytes");
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(dst_shared));
  asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(dst), "l"(src), "n"(Bytes),
               "r"(valid ? Bytes : 0)
               : "memory");
}

// 16 bytes from src to dst_shared through L2 only (cp.async.cg: not kept in L1, for streams read
// once); zero-fills instead when !valid, as copy().
__device__ __forceinline__ void copy_streaming16(void* dst_shared, const void* src, bool valid) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(dst_shared));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(valid ? 16 : 0)
               : "memory");
}

// Closes this thread's current group of copies (an empty group is fine: it keeps the counting of
// a pipeline uniform).
__device__ __forceinline__ void commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}

// Waits until at most Pending of this thread's groups are still in flight.
template <int Pending>
__device__ __forceinline__ void wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(Pending) : "memory");
}

}  // namespace async_copy
}  // namespace mhla_kernels
