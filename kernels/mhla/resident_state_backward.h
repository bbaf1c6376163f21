#pragma once
// MHLA's backward for short sequences in state form, with the whole (batch, head) resident in
// shared memory: the same arguments and results as resident_block_linear_backward
// (resident_block_linear.h), computed through the blocks' D x D states instead of the masked
// N x N scores. With blocks of 16 tokens (N = 256 in 16 blocks) the scores' five products cost
// 3x the tensor-core work of the states':
//
//   S_j = phi(K_j)^T V_j,  S'_i = sum_j m_ij S_j,  dS'_i = phi(Q_i)^T g_i,  dS_j = sum_i m_ij dS'_i,
//   dphi(q_t) = g_t S'_i^T + gd_t z'_i,  dphi(k_s) = v_s dS_j^T + dz_j,  dv_s = phi(k_s) dS_j,
//   dm_ij = <dS'_i, S_j> + dz'_i . z_j,
//
// with g_t = do_t / (den_t + eps), gd_t = -(do_t . o_t) / (den_t + eps), z_j = sum of phi(k)
// over block j, z' = m z, dz'_i = sum_t gd_t phi(q_t), dz = m^T dz'. The value dimension is cut
// into slices of 16 columns, so one slice of all the states fits beside the four token tiles;
// dphi(q) and dphi(k) add up over the slices in registers. The forward's output is not read:
// do_t . o_t = phi(q_t) . (g_t S'^T), the S' part of dphi(q_t), so gd follows the slices.
//
// Takes what the resident kernels take with a mixing matrix, head dim 64 and at most 16 blocks.
#include "mhla/resident_block_linear.h"

namespace mhla_kernels {

bool resident_state_backward_supported(const BlockLinearShape& shape, DType dtype);
cudaError_t resident_state_backward(const ResidentBlockLinearBackward& args, cudaStream_t stream);

}  // namespace mhla_kernels
