#pragma once
// The short-sequence backward of resident_block_linear.h (same arguments, same results) in the
// dense masked form, on Hopper's warpgroup products (wgmma). A CTA of two warpgroups takes one
// (batch, head) at a time, holds phi(q), phi(k), v and g = do / (den + eps) for all N tokens in
// shared memory (and the raw q and k, for the feature map's backward) and computes, per 64 x 64
// tile pair of keys s and queries t,
//
//   A_st  = phi(k_s) . phi(q_t),   dP_st = v_s . g_t + gd_t,   w_st = m_{block(t), block(s)},
//   dv_s += sum_t A_st w_st g_t,   dphi(k_s) += sum_t dP_st w_st phi(q_t),
//   dm_ij = sum over t in i, s in j of dP_st A_st,
//
// with gd_t = -(do_t . o_t) / (den_t + eps). The scores never leave the registers: the products
// that contract over the queries take them as register operands (A), and read g and phi(q) from
// the same shared tiles transposed, so no second copy of a tile is kept. A second sweep, queries
// against keys, recomputes dP for dphi(q_t) = sum_s dP_ts w_ts phi(k_s) (no atomics: every
// gradient row has one owner, and dm's parts are summed in a fixed order).
//
// Against the mma.sync kernels of the same family, a warpgroup product reads each operand tile
// once for four warps instead of once per warp, which is what limited them (shared-memory
// bandwidth and latency). Takes bf16 or fp16, head dim 64, N a multiple of 64 up to 256, and
// blocks of a multiple of 16 tokens.
#include "mhla/resident_block_linear.h"

namespace mhla_kernels {

bool resident_warpgroup_backward_supported(const BlockLinearShape& shape, DType dtype);
// The shape, and views the tensor copy engine can read (16-byte aligned bases and strides).
bool resident_warpgroup_backward_takes(const ResidentBlockLinearBackward& args);
cudaError_t resident_warpgroup_backward(const ResidentBlockLinearBackward& args,
                                        cudaStream_t stream);

}  // namespace mhla_kernels
