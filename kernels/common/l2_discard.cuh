#pragma once
// Dropping dead workspace from L2 without writing it back (discard.global.L2, sm_80+).
//
// Why: a workspace that one kernel writes and the next reads once (the MHLA backward's dS' and
// dS: 50 MB each at B = 64, N = 1,024, H = 6, D = 64, M = 16) is still partly dirty in L2 when it
// is read. Once read it is dead, but L2 would still write those lines back to DRAM when it
// evicts them. The reader discards the lines it has read instead; their contents become
// undefined, so only memory that nothing reads again (the caller's promise) may be discarded.
#include <cstdint>

namespace mhla_kernels {
namespace l2_discard {

constexpr int kLineBytes = 128;

// The lines of [begin, begin + bytes) (both multiples of 128 bytes from a 128-byte aligned
// base), shared by `threads` threads from `thread`.
__device__ __forceinline__ void discard_lines(const void* begin, int64_t bytes, int thread,
                                              int threads) {
  const char* base = static_cast<const char*>(begin);
  for (int64_t line = thread; line < bytes / kLineBytes; line += threads)
    asm volatile("discard.global.L2 [%0], 128;\n" ::"l"(base + line * kLineBytes) : "memory");
}

}  // namespace l2_discard
}  // namespace mhla_kernels
