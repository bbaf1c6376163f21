#pragma once
// torch::nn::Linear with ATen's linear as its forward: for a contiguous input of any rank one
// addmm with the bias fused into the matmul. The C++ frontend's functional linear instead
// multiplies and then adds the bias in place (`output += bias`) for inputs of more than two
// dimensions; under autocast that is a bf16 += fp32 broadcast add, which ATen runs as a slow
// non-vectorized kernel over every activation (on the H200 the largest kernel of a DeiT step:
// 5.9 of 26.3 GPU ms, 49 calls = one per linear layer). Same parameters, names, options and
// initialization as torch::nn::Linear, so checkpoints are unchanged.
#include <torch/torch.h>

namespace mhla {

class LinearImpl : public torch::nn::LinearImpl {
 public:
  using torch::nn::LinearImpl::LinearImpl;
  torch::Tensor forward(const torch::Tensor& input) { return torch::linear(input, weight, bias); }
};
TORCH_MODULE(Linear);

}  // namespace mhla
