#include "attention/causal_linear.h"

#include "attention/attention_op.h"

namespace mhla {

torch::Tensor causal_mixing_matrix(const torch::Tensor& mixing, int64_t blocks) {
  const int64_t m = mixing.size(0);
  auto lower = mixing.tril();
  if (blocks <= m) return lower.narrow(0, 0, blocks).narrow(1, 0, blocks);
  // Rows past the trained length, from the last row (see the header): row i reads
  // m_{M-1, max(0, j - s)} for columns j <= i, with s = i - M + 1 the first block of its window.
  // One gather for all rows (a loop of row concatenations cost thousands of small ops at 512
  // blocks); the gradient reaches the learned entries through it.
  const auto index_options = mixing.options().dtype(torch::kLong);
  auto rows = torch::arange(m, blocks, index_options).unsqueeze(1);  // [blocks - M, 1]
  auto columns = torch::arange(blocks, index_options).unsqueeze(0);  // [1, blocks]
  auto source = (columns - (rows - (m - 1))).clamp(0, m - 1);        // [blocks - M, blocks]
  auto extended = lower[m - 1].index_select(0, source.flatten()).view(source.sizes());
  extended = extended.masked_fill(columns > rows, 0.0);
  auto top = torch::cat({lower, torch::zeros({m, blocks - m}, mixing.options())}, 1);
  return torch::cat({top, extended}, 0);
}

namespace {

// Shared chunked computation: per-block states with the normalizer riding as a ones column,
// prefix mixing over whole earlier blocks, masked intra-block products.
torch::Tensor causal_block_attention(const torch::Tensor& q, const torch::Tensor& k,
                                     const torch::Tensor& v, const torch::Tensor& mixing) {
  const auto b = q.size(0), t = q.size(1), h = q.size(2), d = q.size(3), dv = v.size(3);
  const auto dtype = reference_compute_dtype(v);
  const int64_t c = kCausalBlock, nb = (t + c - 1) / c, padded = nb * c;
  // Padding goes after the last token, so it never reaches a real one.
  auto pad = [&](const torch::Tensor& x) {
    return padded == t ? x : torch::constant_pad_nd(x, {0, 0, 0, 0, 0, padded - t}, 0.0);
  };
  auto to_blocks = [&](const torch::Tensor& x) {  // [B, T', H, E] -> [B, H, nb, C, E]
    return x.view({b, nb, c, h, x.size(3)}).permute({0, 3, 1, 2, 4});
  };
  auto qf = to_blocks(pad(feature_map(q.to(dtype))));
  auto kf = to_blocks(pad(feature_map(k.to(dtype))));
  auto v1 = to_blocks(
      pad(torch::cat({v.to(dtype), torch::ones({b, t, h, 1}, v.options().dtype(dtype))}, -1)));
  auto states = torch::matmul(kf.transpose(-1, -2), v1);  // [B, H, nb, D, Dv+1]
  auto weights = mixing.defined() ? causal_mixing_matrix(mixing.to(dtype), nb)
                                  : torch::ones({nb, nb}, v.options().dtype(dtype)).tril();
  auto prefix_weights = weights.tril(-1);  // whole earlier blocks
  auto prefix = torch::matmul(prefix_weights, states.reshape({b, h, nb, d * (dv + 1)}))
                    .view({b, h, nb, d, dv + 1});
  auto causal = torch::ones({c, c}, q.options().dtype(torch::kBool)).tril();
  auto scores = torch::matmul(qf, kf.transpose(-1, -2)).masked_fill(~causal, 0.0);
  scores = scores * weights.diagonal().view({1, 1, nb, 1, 1});       // E_ii inside block i
  auto out = torch::matmul(qf, prefix) + torch::matmul(scores, v1);  // [B, H, nb, C, Dv+1]
  auto result = out.narrow(-1, 0, dv) / (out.narrow(-1, dv, 1) + kNormalizerEps);
  return result.permute({0, 2, 3, 1, 4})
      .reshape({b, padded, h, dv})
      .narrow(1, 0, t)
      .to(v.scalar_type());
}

}  // namespace

torch::Tensor causal_linear_attention_reference(const torch::Tensor& q, const torch::Tensor& k,
                                                const torch::Tensor& v) {
  return causal_block_attention(q, k, v, /*mixing=*/{});
}

torch::Tensor causal_mhla_reference(const torch::Tensor& q, const torch::Tensor& k,
                                    const torch::Tensor& v, const torch::Tensor& mixing) {
  return causal_block_attention(q, k, v, mixing);
}

namespace {

// phi(k)^T [v, 1] for one token: [B, H, D, Dv + 1] in the compute dtype.
torch::Tensor token_state(const torch::Tensor& k, const torch::Tensor& v) {
  const auto dtype = reference_compute_dtype(v);
  auto kf = feature_map(k.to(dtype)).squeeze(1);  // [B, H, D]
  auto v1 =
      torch::cat({v.to(dtype), torch::ones_like(v.narrow(-1, 0, 1), v.options().dtype(dtype))}, -1)
          .squeeze(1);  // [B, H, Dv + 1]
  return kf.unsqueeze(-1) * v1.unsqueeze(-2);
}

torch::Tensor read_state(const torch::Tensor& q, const torch::Tensor& state,
                         const torch::Tensor& v) {
  const auto dv = v.size(3);
  auto qf = feature_map(q.to(state.scalar_type())).squeeze(1);  // [B, H, D]
  auto out = torch::einsum("bhd,bhde->bhe", {qf, state});
  auto result = out.narrow(-1, 0, dv) / (out.narrow(-1, dv, 1) + kNormalizerEps);
  return result.unsqueeze(1).to(v.scalar_type());  // [B, 1, H, Dv]
}

}  // namespace

torch::Tensor causal_linear_decode(const torch::Tensor& q, const torch::Tensor& k,
                                   const torch::Tensor& v, DecodeState& state) {
  auto update = token_state(k, v);
  if (state.tensors.empty()) state.tensors = {torch::zeros_like(update)};
  state.tensors[0] = state.tensors[0] + update;
  return read_state(q, state.tensors[0], v);
}

torch::Tensor causal_mhla_decode(const torch::Tensor& q, const torch::Tensor& k,
                                 const torch::Tensor& v, const torch::Tensor& mixing,
                                 DecodeState& state) {
  // tensors[0]: the current block's running summary; tensors[1..]: finished blocks, in order.
  auto update = token_state(k, v);
  if (state.tensors.empty()) {
    state.tensors = {torch::zeros_like(update)};
  } else if (state.position % kCausalBlock == 0) {
    state.tensors.push_back(state.tensors[0]);  // the previous block is complete
    state.tensors[0] = torch::zeros_like(update);
  }
  state.tensors[0] = state.tensors[0] + update;
  const int64_t block = state.position / kCausalBlock;
  auto weights = causal_mixing_matrix(mixing.to(update.scalar_type()), block + 1)[block];
  auto mixed = weights[block] * state.tensors[0];
  for (int64_t b = 0; b < block; ++b) mixed = mixed + weights[b] * state.tensors[1 + b];
  return read_state(q, mixed, v);
}

}  // namespace mhla
