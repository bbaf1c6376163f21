#pragma once
#include "attention/attention_op.h"

namespace mhla {

// Bidirectional linear attention with phi = feature_map:
//   o_i = phi(q_i) S / (phi(q_i) . z + eps),  S = sum_j phi(k_j) v_j^T,  z = sum_j phi(k_j).
// Computes in float32 (float64 for float64 inputs); returns v's dtype.
torch::Tensor linear_attention_reference(const torch::Tensor& q, const torch::Tensor& k,
                                         const torch::Tensor& v, const OpArgs& args);

}  // namespace mhla
