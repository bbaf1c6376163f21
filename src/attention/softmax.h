#pragma once
#include "attention/attention_op.h"

namespace mhla {

// softmax(q k^T / sqrt(D)) v through at::scaled_dot_product_attention (flash / cuDNN / math as
// ATen picks for the device and dtype).
torch::Tensor softmax_attention_reference(const torch::Tensor& q, const torch::Tensor& k,
                                          const torch::Tensor& v, const OpArgs& args);

}  // namespace mhla
