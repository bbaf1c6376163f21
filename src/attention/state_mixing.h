#pragma once
// Mixing fp32 block states on the GPU, shared by the bidirectional and causal MHLA bindings (builds
// with the CUDA kernels only): the mix itself by the state-mix kernel (kernels/mhla/
// block_state_mix; a batched cuBLAS GEMM past its 128 blocks), and the mixing matrix's gradient by
// the pair-products kernel (kernels/mhla/block_pair_products). The states stay fp32 whatever the
// step's precision.
#ifdef MHLA_WITH_CUDA_KERNELS
#include <torch/torch.h>

#include <utility>

#include "mhla/block_state_mix.h"

namespace mhla {

// [BH, nb, E] fp32 states mixed by [nb, nb] fp32 weights (the same for every batch*head):
// out[b, i] = sum_j weights[i, j] * states[b, j]. `pattern` promises zeros on and above (lower)
// or on and below (upper) the diagonal, which the kernel then skips. packed_matrix > 0 returns
// a packed set of causal prefixes instead (kernels/mhla/causal_block_linear.h): the first
// packed_matrix elements of each row in bf16, [BH, nb, packed_matrix / 2 + E - packed_matrix].
// packed_in: `states` is such a packed set too (the bidirectional MHLA binding's block states at
// one chunk per block, kernels/mhla/block_linear_attention.h packed_states).
torch::Tensor mix_block_states(const torch::Tensor& weights, const torch::Tensor& states,
                               mhla_kernels::MixPattern pattern = mhla_kernels::MixPattern::dense,
                               int64_t packed_matrix = 0, bool packed_in = false);

// G [rows, rows] fp32, G_ij = sum over the first dimension and the elements of x[:, i] * y[:, j],
// for x, y [BH, nb, E] fp32 contiguous on one GPU (rows <= min(nb, 64), E a multiple of 4).
// packed_matrix > 0: x and y are packed sets (as mix_block_states returns them) of
// packed_matrix bf16 and E - packed_matrix fp32 elements per row, stored in
// packed_matrix / 2 + E - packed_matrix floats.
torch::Tensor block_pair_products(const torch::Tensor& x, const torch::Tensor& y, int64_t rows,
                                  int64_t packed_matrix = 0);

// The backward pass of out = mix_block_states(mixing, states) for dense [nb, nb] mixing: returns
// {d states [BH, nb, E], d mixing [nb, nb]} from d out. One fused kernel for nb <= 32
// (kernels/mhla/block_mix_backward; MHLA_FUSED_MIX_BACKWARD=0 turns it off), else the mix by the
// transposed matrix and the pair products. packed_matrix > 0 returns d states as a packed set,
// as mix_block_states does. packed_inputs: d out and the states are packed sets of the same
// matrix part (packed_matrix > 0; the bidirectional MHLA binding at one chunk per block).
// zeroed_dm: an fp32 [nb, nb] tensor that an earlier kernel on the stream has zeroed (the query
// pass does, so no fill kernel stands between it and this one); the fused kernel adds d mixing
// into it and returns it. Undefined: a new zero tensor.
// With deterministic sums on (core/determinism.h) the fused kernel writes one part of d mixing per
// CTA, summed in a fixed order into the returned d mixing here, or, given `mixing_parts`, handed
// there [parts, nb, nb] for the caller to sum into it (column_sums_into, models/linear.h) after its
// next launch, so that no reduction stands between this kernel and that one.
std::pair<torch::Tensor, torch::Tensor> mix_block_states_backward(
    const torch::Tensor& mixing, const torch::Tensor& grad_mixed, const torch::Tensor& states,
    int64_t packed_matrix = 0, bool packed_inputs = false, torch::Tensor zeroed_dm = {},
    torch::Tensor* mixing_parts = nullptr);

}  // namespace mhla
#endif
