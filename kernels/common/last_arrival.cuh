#pragma once
// "The last CTA to finish a group does the group's follow-up work": each CTA that finishes one
// member of a group (here: one block state of a batch*head) counts itself in on the group's
// counter; the CTA that brings the count to `members` sees every member's writes and may read
// them. This replaces a separate kernel launch whose only job was to wait for a whole grid, and
// the follow-up reads what the members just wrote while it is still in L2.
//
// Counters live in global memory, zero before the first arrival; the last CTA sets its counter
// back to zero, so after a kernel has run to completion its counters are zero again and the same
// buffer serves the next launch on the stream.
namespace mhla_kernels {
namespace last_arrival {

// Called by every thread of the CTA, after the thread's writes of its member. Returns true in all
// threads of the CTA that arrived last; its later reads see every member's writes (read them
// through L2: cp.async.cg or ld.global.cg, not the non-coherent path).
__device__ __forceinline__ bool arrive(int* counter, int members) {
  __shared__ int last;
  __threadfence();  // this thread's writes are visible GPU-wide before the count says so
  __syncthreads();
  if (threadIdx.x == 0) {
    last = atomicAdd(counter, 1) == members - 1;
    if (last) *counter = 0;  // every member has counted: ready for the next launch
  }
  __syncthreads();
  const bool is_last = last;
  if (is_last) __threadfence();  // order this CTA's reads after the other members' writes
  return is_last;
}

}  // namespace last_arrival
}  // namespace mhla_kernels
