#pragma once
// A linear layer's weight and bias gradients, dW = dy^T x and db = sum of dy over the rows, in
// fp32. On CUDA with 16-bit operands both come from one cuBLASLt product whose epilogue reduces
// the bias gradient as it reads dy (kernels/gemm_epilogue/weight_gradient.h); elsewhere, or with
// MHLA_BGRAD_EPILOGUE=0, dW is a torch product and db the column sums of linear.h.
#include <utility>

#include <torch/torch.h>

namespace mhla {

// dy [rows, out] and x [rows, in], contiguous, the same dtype. Returns {dW [out, in], db [out]}
// in fp32 (fp64 for fp64 inputs); db is undefined unless with_bias.
std::pair<torch::Tensor, torch::Tensor> weight_gradients(const torch::Tensor& dy,
                                                         const torch::Tensor& x, bool with_bias);

}  // namespace mhla
