#pragma once
// The short-sequence forward of resident_block_linear.h (same arguments, same results) on
// Hopper's warpgroup products (wgmma), the counterpart of resident_warpgroup_backward.h. A
// persistent CTA takes one (batch, head) at a time; the tensor copy engine brings its q, k and v
// (all N tokens) into one of two tile sets while the other set's pair is computed, so loads
// overlap the products. Per 64-query tile t, the warpgroup that owns it walks the key tiles s:
// at N = 192 and 256 a warpgroup per query tile and 64 keys per product; at N = 64 and 128 two
// warpgroups and, at N = 128, 128 keys (a wider product reads less shared memory per flop and
// halves the waits):
//
//   A_ts = phi(q_t) . phi(k_s)   (shared-memory operands),   P_ts = A_ts w_ts,
//   den_t += row sums of P_ts (fp32),   o_t += P_ts v_s   (P from registers, v read transposed),
//
// and stores o_t / (den_t + eps) and den_t. Takes bf16 or fp16, head dim 64, N a multiple of 64
// up to 256, blocks of whole 16-token chunks, and views with 16-byte aligned bases and strides.
#include "mhla/resident_block_linear.h"

namespace mhla_kernels {

bool resident_warpgroup_forward_takes(const ResidentBlockLinearForward& args);
cudaError_t resident_warpgroup_forward(const ResidentBlockLinearForward& args, cudaStream_t stream);

}  // namespace mhla_kernels
