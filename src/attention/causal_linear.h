#pragma once
// Causal forms of linear attention and MHLA (language models), chunk = block = 64 tokens.
//   linear: o_t = phi(q_t) S_t / (phi(q_t) . z_t + eps), S_t = sum_{s<=t} phi(k_s) v_s^T.
//   MHLA:   tokens in blocks of 64; a query in block i reads the prefix mixture
//           sum_{b<i} E_ib S_b of whole earlier blocks plus E_ii * (its own block up to itself),
//           normalized the same way (E = the causal mixing matrix below).
#include <torch/torch.h>

#include "attention/attention_op.h"

namespace mhla {

constexpr int64_t kCausalBlock = 64;

// The causal mixing matrix for a sequence of `blocks` blocks from the learned lower-triangular
// M x M matrix. Within the trained length (blocks <= M) it is M's top-left corner. Beyond it
// (the stated policy for long sequences) block i >= M reads the last M - 1 blocks and itself
// with the weights of M's last row, m_{M-1, 1..M-1}, and every older block with
// m_{M-1, 0}: the oldest block of the trained window stands for all history before it. The
// policy agrees with the trained matrix at i = M - 1 and lets decoding keep M - 1 block
// summaries plus one running sum of older ones.
torch::Tensor causal_mixing_matrix(const torch::Tensor& mixing, int64_t blocks);

// q, k [B, T, H, D], v [B, T, H, Dv]; float32 compute (float64 for float64 inputs).
torch::Tensor causal_linear_attention_reference(const torch::Tensor& q, const torch::Tensor& k,
                                                const torch::Tensor& v);
torch::Tensor causal_mhla_reference(const torch::Tensor& q, const torch::Tensor& k,
                                    const torch::Tensor& v, const torch::Tensor& mixing);

// One-token decoding steps (q, k, v [B, 1, H, D]) that equal the references position by position.
// Linear keeps one running state; MHLA keeps its finished block summaries and the current
// block's, and mixes them with the row of causal_mixing_matrix for the current block.
torch::Tensor causal_linear_decode(const torch::Tensor& q, const torch::Tensor& k,
                                   const torch::Tensor& v, DecodeState& state);
torch::Tensor causal_mhla_decode(const torch::Tensor& q, const torch::Tensor& k,
                                 const torch::Tensor& v, const torch::Tensor& mixing,
                                 DecodeState& state);

}  // namespace mhla
