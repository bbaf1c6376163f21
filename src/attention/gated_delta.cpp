#include "attention/gated_delta.h"

#include <algorithm>
#include <cstdlib>
#include <functional>

#include "attention/delta_chunk_recurrence.h"
#include "core/error.h"

namespace mhla {
namespace {

torch::ScalarType state_dtype(const torch::Tensor& v) {
  return v.scalar_type() == torch::kFloat64 ? torch::kFloat64 : torch::kFloat32;
}

void check_shapes(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                  const torch::Tensor& beta, const torch::Tensor& g,
                  const torch::Tensor& initial_state) {
  TORCH_CHECK(q.dim() == 4 && k.sizes() == q.sizes(), "delta rule: q, k must be [B, T, H, Dk]");
  TORCH_CHECK(
      v.dim() == 4 && v.size(0) == q.size(0) && v.size(1) == q.size(1) && v.size(2) == q.size(2),
      "delta rule: v must be [B, T, H, Dv]");
  TORCH_CHECK(beta.sizes() == q.sizes().slice(0, 3), "delta rule: beta must be [B, T, H]");
  TORCH_CHECK((g.dim() == 3 && g.sizes() == q.sizes().slice(0, 3)) ||
                  (g.dim() == 4 && g.sizes() == q.sizes()),
              "delta rule: g must be [B, T, H] or [B, T, H, Dk]");
  if (initial_state.defined()) {
    TORCH_CHECK(initial_state.dim() == 4 && initial_state.size(0) == q.size(0) &&
                    initial_state.size(1) == q.size(2) && initial_state.size(2) == q.size(3) &&
                    initial_state.size(3) == v.size(3),
                "delta rule: initial_state must be [B, H, Dk, Dv]");
  }
}

// sum_d x_r[d] k_s[d] exp(G_r[d] - G_s[d]) for s <= r inside one chunk, zero above (KDA: one
// decay per key dimension), without the chunk's full [C, C, Dk] pairwise decays: the rows of each
// 8-token sub-chunk reach earlier tokens through the decay to the sub-chunk's first token
// (both factors exp(G_r - G_m) and exp(G_m - G_s) are <= 1, so strong decay cannot overflow) and
// their own sub-chunk through exact pairwise decays. x, k, cum: [B, H, C, Dk] -> [B, H, C, C].
torch::Tensor decayed_products_per_key(const torch::Tensor& x, const torch::Tensor& k,
                                       const torch::Tensor& cum) {
  // 8 rather than 16: the exact part costs sub-chunk^2 x Dk per row block, and at 8 the per-key
  // decays and their einsum move half the bytes (CPU, fp32, forward+backward: 1,554 -> 742 ms at
  // B 1, H 4, T 4,096, Dk 128; 244 -> 184 ms at B 2, T 1,024, Dk 64; 4 was slower than 8).
  constexpr int64_t kSub = 8;
  const int64_t c = x.size(2);
  std::vector<torch::Tensor> row_blocks;
  for (int64_t first = 0; first < c; first += kSub) {
    const int64_t rows = std::min(kSub, c - first);
    auto xi = x.narrow(2, first, rows), ki = k.narrow(2, first, rows);
    auto gi = cum.narrow(2, first, rows);
    std::vector<torch::Tensor> parts;
    if (first > 0) {
      auto reference = cum.narrow(2, first, 1);
      auto x_decayed = xi * torch::exp(gi - reference);
      auto k_decayed = k.narrow(2, 0, first) * torch::exp(reference - cum.narrow(2, 0, first));
      parts.push_back(torch::matmul(x_decayed, k_decayed.transpose(-1, -2)));
    }
    auto inside = torch::ones({rows, rows}, cum.options().dtype(torch::kBool)).tril();
    auto pair_decay = torch::exp(
        (gi.unsqueeze(3) - gi.unsqueeze(2)).masked_fill(~inside.unsqueeze(-1), -INFINITY));
    parts.push_back(torch::einsum("bhrd,bhsd,bhrsd->bhrs", {xi, ki, pair_decay}));
    if (first + rows < c) {
      parts.push_back(torch::zeros({x.size(0), x.size(1), rows, c - first - rows}, x.options()));
    }
    row_blocks.push_back(torch::cat(parts, -1));
  }
  return torch::cat(row_blocks, 2);
}

}  // namespace

torch::Tensor unit_lower_solve(const torch::Tensor& a, const torch::Tensor& rhs) {
  // A batched triangular solve. (Session 6 tried the nilpotent product series (I - A)(I + A^2)...
  // as matmuls only: slower on the H200, 21.3 vs 17.4 ms for gated DeltaNet at T = 2,048, and on
  // the CPU, so it was removed.)
  return at::linalg_solve_triangular(torch::eye(a.size(-1), a.options()) + a, rhs,
                                     /*upper=*/false, /*left=*/true, /*unitriangular=*/true);
}

namespace {

// The chunked WY form with everything that does not depend on the running state computed for
// all chunks at once: the intra-chunk matrix A_rs = beta_r sum_d k_r[d] k_s[d] exp(G_r - G_s)[d]
// (s < r), one batched triangular solve for W = (I + A)^-1 diag(beta) (Gamma . K) and
// U0 = (I + A)^-1 diag(beta) V, the decayed q k^T products and the decays to each chunk's end.
// Only the state carried between chunks, u = U0 - W S and S' = Diag(exp G_C) S + (decayed K)^T u,
// is sequential (delta_chunk_recurrence; by linearity u equals (I + A)^-1 diag(beta)
// (V - (Gamma . K) S)); the outputs o = (Gamma . Q) S + QK u are formed for all chunks after it. G
// is the gate's running sum inside a chunk: one per head and token (gated DeltaNet; the pairwise
// decays are scalars and the products plain matmuls) or one per key dimension (KDA;
// decayed_products_per_key). The sequence is padded to whole chunks with beta = 0, g = 0, q = k = v
// = 0: padded tokens neither write nor decay the state. Inputs [B, H, T, .] in the compute dtype, g
// [B, H, T] or [B, H, T, Dk]; returns the unscaled output [B, H, T, Dv] and the final state.
std::pair<torch::Tensor, torch::Tensor> chunked_wy(const torch::Tensor& q, const torch::Tensor& k,
                                                   const torch::Tensor& v,
                                                   const torch::Tensor& beta,
                                                   const torch::Tensor& g, torch::Tensor state,
                                                   int64_t chunk, DeltaCarry carry) {
  const auto b = q.size(0), h = q.size(1), t_total = q.size(2), dk = q.size(3), dv = v.size(3);
  const bool per_key = g.dim() == 4;
  const int64_t c = std::min(chunk, t_total);
  const int64_t chunks = (t_total + c - 1) / c, pad = chunks * c - t_total;
  auto in_chunks = [&](const torch::Tensor& x) {  // [B, H, T, ...] -> [B, H, chunks, C, ...]
    std::vector<int64_t> padding(2 * (x.dim() - 2), 0);
    padding.back() = pad;  // the time dimension is the last one listed (dim 2)
    auto padded = pad > 0 ? at::constant_pad_nd(x, padding, 0.0) : x;
    auto sizes = padded.sizes().vec();
    sizes[2] = c;
    sizes.insert(sizes.begin() + 2, chunks);
    return padded.reshape(sizes);
  };
  auto qc = in_chunks(q), kc = in_chunks(k), vc = in_chunks(v);
  auto bc = in_chunks(beta).unsqueeze(-1);  // [B, H, n, C, 1]
  auto cum = in_chunks(g).cumsum(3);        // G_r within each chunk: [B, H, n, C(, Dk)]
  std::function<torch::Tensor(const torch::Tensor&)> decayed_products;  // x [B, H, n, C, Dk]
  torch::Tensor gamma, to_end, chunk_decay;  // exp(G_r), exp(G_C - G_r), exp(G_C) per key dim
  if (per_key) {
    decayed_products = [&](const torch::Tensor& x) {  // chunks folded into the head dimension
      auto fold = [&](const torch::Tensor& y) { return y.reshape({b, h * chunks, c, dk}); };
      return decayed_products_per_key(fold(x), fold(kc), fold(cum)).view({b, h, chunks, c, c});
    };
    auto last = cum.narrow(3, c - 1, 1);               // [B, H, n, 1, Dk]
    gamma = torch::exp(cum);                           // [B, H, n, C, Dk]
    to_end = torch::exp(last - cum);                   // [B, H, n, C, Dk]
    chunk_decay = torch::exp(last).transpose(-1, -2);  // [B, H, n, Dk, 1]
  } else {
    auto causal = torch::ones({c, c}, cum.options().dtype(torch::kBool)).tril();
    // exp(G_r - G_s) <= 1 for s <= r: strong decay cannot overflow.
    auto pair_decay =
        torch::exp((cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(~causal, -INFINITY));
    decayed_products = [&, pair_decay](const torch::Tensor& x) {
      return torch::matmul(x, kc.transpose(-1, -2)) * pair_decay;
    };
    auto last = cum.narrow(3, c - 1, 1);            // [B, H, n, 1]
    gamma = torch::exp(cum).unsqueeze(-1);          // [B, H, n, C, 1]
    to_end = torch::exp(last - cum).unsqueeze(-1);  // [B, H, n, C, 1]
    chunk_decay = torch::exp(last).unsqueeze(-1);   // [B, H, n, 1, 1]
  }
  auto strict = torch::ones({c, c}, cum.options().dtype(torch::kBool)).tril(-1);
  auto a = (bc * decayed_products(kc)).masked_fill(~strict, 0.0);
  auto solved = unit_lower_solve(a, torch::cat({bc * gamma * kc, bc * vc}, -1));
  auto w = solved.narrow(-1, 0, dk), u0 = solved.narrow(-1, dk, dv);
  auto qk = decayed_products(qc);
  auto gamma_q = gamma * qc;
  auto to_end_k = to_end * kc;  // [B, H, n, C, Dk]
  // The state passed from chunk to chunk (the only sequential part), then every chunk's output
  // o_i = (Gamma . Q)_i S_i + QK_i u_i at once.
  auto decay = chunk_decay.squeeze(-1).expand({b, h, chunks, dk});
  auto carried = carry == DeltaCarry::kernel
                     ? delta_chunk_recurrence(u0, w, to_end_k, decay, state)
                     : delta_chunk_recurrence_reference(u0, w, to_end_k, decay, state);
  auto out = (torch::matmul(gamma_q, carried.states) + torch::matmul(qk, carried.u))
                 .reshape({b, h, chunks * c, dv})
                 .narrow(2, 0, t_total);
  return {out, carried.final};
}

}  // namespace

torch::Tensor delta_rule_step(torch::Tensor& state, const torch::Tensor& q, const torch::Tensor& k,
                              const torch::Tensor& v, const torch::Tensor& beta,
                              const torch::Tensor& g, double scale) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  const auto dtype = state.scalar_type();
  auto decay = torch::exp(g.to(dtype));
  if (decay.dim() == 2) decay = decay.unsqueeze(-1);  // [B, H, 1]: one per head
  auto kf = k.to(dtype), qf = q.to(dtype);
  auto decayed = state * decay.unsqueeze(-1);                      // Diag(exp g) S
  auto predicted = torch::einsum("bhkv,bhk->bhv", {decayed, kf});  // S~^T k
  auto update = beta.to(dtype).unsqueeze(-1) * (v.to(dtype) - predicted);
  state = decayed + kf.unsqueeze(-1) * update.unsqueeze(-2);  // + k u^T
  return (scale * torch::einsum("bhkv,bhk->bhv", {state, qf})).to(v.scalar_type());
}

DeltaRuleOutput delta_rule_recurrent(const torch::Tensor& q, const torch::Tensor& k,
                                     const torch::Tensor& v, const torch::Tensor& beta,
                                     const torch::Tensor& g, const torch::Tensor& initial_state,
                                     double scale) {
  check_shapes(q, k, v, beta, g, initial_state);
  const auto dtype = state_dtype(v);
  auto state = initial_state.defined() ? initial_state.to(dtype)
                                       : torch::zeros({q.size(0), q.size(2), q.size(3), v.size(3)},
                                                      v.options().dtype(dtype));
  std::vector<torch::Tensor> outs;
  for (int64_t t = 0; t < q.size(1); ++t) {
    outs.push_back(delta_rule_step(state, q.select(1, t), k.select(1, t), v.select(1, t),
                                   beta.select(1, t), g.select(1, t), scale));
  }
  return {torch::stack(outs, 1), state};
}

DeltaRuleOutput delta_rule_chunked(const torch::Tensor& q, const torch::Tensor& k,
                                   const torch::Tensor& v, const torch::Tensor& beta,
                                   const torch::Tensor& g, const torch::Tensor& initial_state,
                                   double scale, int64_t chunk, DeltaCarry carry) {
  check_shapes(q, k, v, beta, g, initial_state);
  // The reference keeps its own precision (float32 state and products) under autocast.
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  TORCH_CHECK(chunk >= 1, "delta rule: chunk must be positive");
  const auto dtype = state_dtype(v);
  const auto b = q.size(0), h = q.size(2), dk = q.size(3), dv = v.size(3);
  // [B, H, T, .] layout in the compute dtype.
  auto qf = q.to(dtype).transpose(1, 2), kf = k.to(dtype).transpose(1, 2);
  auto vf = v.to(dtype).transpose(1, 2);
  auto betaf = beta.to(dtype).transpose(1, 2);  // [B, H, T]
  auto state = initial_state.defined() ? initial_state.to(dtype)
                                       : torch::zeros({b, h, dk, dv}, v.options().dtype(dtype));
  auto [out, final_state] =
      chunked_wy(qf, kf, vf, betaf, g.to(dtype).transpose(1, 2).contiguous(), state, chunk, carry);
  return {(scale * out).transpose(1, 2).to(v.scalar_type()), final_state};
}

}  // namespace mhla
