#pragma once
// Mixing fp32 block states on the GPU, shared by the bidirectional and causal MHLA bindings (builds
// with the CUDA kernels only): the mix itself as one batched cuBLAS GEMM, and the mixing matrix's
// gradient by the pair-products kernel (kernels/mhla/block_pair_products). Both run outside
// autocast: the states stay fp32 whatever the step's precision.
#ifdef MHLA_WITH_CUDA_KERNELS
#include <torch/torch.h>

namespace mhla {

// [BH, nb, E] fp32 states mixed by [nb, nb] fp32 weights (the same for every batch*head):
// out[b, i] = sum_j weights[i, j] * states[b, j].
torch::Tensor mix_block_states(const torch::Tensor& weights, const torch::Tensor& states);

// G [rows, rows] fp32, G_ij = sum over the first dimension and the elements of x[:, i] * y[:, j],
// for x, y [BH, nb, E] fp32 contiguous on one GPU (rows <= min(nb, 64), E a multiple of 4).
torch::Tensor block_pair_products(const torch::Tensor& x, const torch::Tensor& y, int64_t rows);

}  // namespace mhla
#endif
