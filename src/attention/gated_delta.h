#pragma once
// Gated delta rule references (plain LibTorch, fp32 state; float64 in, float64 out), fla's
// conventions: q, k [B, T, H, Dk], v [B, T, H, Dv], beta [B, T, H] in (0, 1), log-space gate
// g <= 0 as [B, T, H] (gated DeltaNet: one decay per head and token) or [B, T, H, Dk] (KDA: one
// per key dimension), state S [B, H, Dk, Dv], o_t = scale * S_t^T q_t.
//   gated DeltaNet: S_t = exp(g_t) (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T
//   KDA:            S_t = (I - b_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + b_t k_t v_t^T
// (identical when every key dimension shares the gate). q and k are used as given: the layer
// L2-normalizes them.
#include <torch/torch.h>

namespace mhla {

struct DeltaRuleOutput {
  torch::Tensor out;          // [B, T, H, Dv], dtype of v
  torch::Tensor final_state;  // [B, H, Dk, Dv], float32 (float64 for float64 inputs)
};

// Token by token, exactly the recurrence above. `initial_state` may be undefined (zeros).
DeltaRuleOutput delta_rule_recurrent(const torch::Tensor& q, const torch::Tensor& k,
                                     const torch::Tensor& v, const torch::Tensor& beta,
                                     const torch::Tensor& g, const torch::Tensor& initial_state,
                                     double scale);

// How the chunked form carries the state from chunk to chunk: the loop of LibTorch ops (the
// reference), or the CUDA kernels of kernels/gated_delta/chunk_recurrence (fp32 on a GPU with
// Dk <= 256, a multiple of 4; other inputs take the loop).
enum class DeltaCarry { reference, kernel };

// The chunked form (chunk 64 by default): inside a chunk the delta-rule updates are solved at
// once through the WY/UT transform U = (I + A)^{-1} diag(beta) (V - (Gamma . K) S0), with the
// pairwise decays exp(G_r - G_s) <= 1 formed directly so strong decay cannot overflow; states
// pass between chunks. T need not be a multiple of the chunk.
DeltaRuleOutput delta_rule_chunked(const torch::Tensor& q, const torch::Tensor& k,
                                   const torch::Tensor& v, const torch::Tensor& beta,
                                   const torch::Tensor& g, const torch::Tensor& initial_state,
                                   double scale, int64_t chunk = 64,
                                   DeltaCarry carry = DeltaCarry::reference);

// One decoding step for a single token (q, k [B, H, Dk], v [B, H, Dv], beta [B, H], g [B, H] or
// [B, H, Dk]): updates `state` [B, H, Dk, Dv] in place and returns o [B, H, Dv].
torch::Tensor delta_rule_step(torch::Tensor& state, const torch::Tensor& q, const torch::Tensor& k,
                              const torch::Tensor& v, const torch::Tensor& beta,
                              const torch::Tensor& g, double scale);

// (I + A)^-1 R for a strictly lower-triangular A [..., C, C] (the chunk's WY system): a batched
// triangular solve with a unit diagonal.
torch::Tensor unit_lower_solve(const torch::Tensor& a, const torch::Tensor& rhs);

}  // namespace mhla
