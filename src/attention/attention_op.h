#pragma once
// The interface every attention op implements, whatever its backend:
// q, k, v are [B, N, H, D] (token-major, as they come out of the QKV projection) and the
// result is [B, N, H, Dv] in the dtype of v.
#include <functional>
#include <map>
#include <string>
#include <vector>

#include <torch/torch.h>

namespace mhla {

struct OpArgs {
  bool causal = false;
  int64_t blocks = 1;    // MHLA: number of contiguous token blocks (N % blocks == 0)
  torch::Tensor mixing;  // MHLA: [blocks, blocks] block-mixing matrix
  torch::Tensor beta;    // delta rule: [B, N, H] write strengths in (0, 1)
  torch::Tensor gate;    // delta rule: log decays <= 0, [B, N, H] or [B, N, H, Dk] (KDA)
};

// The shape of an op call, for harnesses that make inputs.
struct OpShape {
  int64_t batch = 1, tokens = 1, heads = 1, head_dim = 1;
  int64_t blocks = 1;
  bool causal = false;
};

using OpFn = std::function<torch::Tensor(const torch::Tensor& q, const torch::Tensor& k,
                                         const torch::Tensor& v, const OpArgs& args)>;

// What a causal layer keeps between decoded tokens: the count of tokens seen and layer-specific
// tensors (softmax: the KV cache; linear: the running state; MHLA: the finished block summaries
// and the current block's; gated DeltaNet: the conv window and the delta-rule state).
struct DecodeState {
  int64_t position = 0;
  std::vector<torch::Tensor> tensors;
};

// One decoding step of an op: q, k, v [B, 1, H, D] at position state.position -> [B, 1, H, Dv].
using DecodeFn = std::function<torch::Tensor(const torch::Tensor& q, const torch::Tensor& k,
                                             const torch::Tensor& v, const OpArgs& args,
                                             DecodeState& state)>;

// Shared by the linear-attention family: phi(x) = relu(RMSNorm(x)) + 1e-6 (RMSNorm without
// weight, over the head dimension) and the normalizer's epsilon.
constexpr double kFeatureFloor = 1e-6;
constexpr double kFeatureNormEps = 1e-6;
constexpr double kNormalizerEps = 1e-6;
torch::Tensor feature_map(const torch::Tensor& x);

// The shared reference computation of linear attention (blocks = 1, no mixing) and
// bidirectional MHLA: per block j, S_j = phi(K_j)^T [V_j, 1]; mixed S'_i = sum_j m_ij S_j;
// o = (phi(Q_i) S'_i)[:Dv] / ((phi(Q_i) S'_i)[Dv] + eps). Three batched matmuls in all.
torch::Tensor block_linear_attention(const torch::Tensor& q, const torch::Tensor& k,
                                     const torch::Tensor& v, const torch::Tensor& mixing,
                                     int64_t blocks);

// The dtype references compute in: double stays double, everything else goes to float32.
torch::ScalarType reference_compute_dtype(const torch::Tensor& x);

}  // namespace mhla
