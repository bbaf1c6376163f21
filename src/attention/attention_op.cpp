#include "attention/attention_op.h"

namespace mhla {

torch::Tensor feature_map(const torch::Tensor& x) {
  auto normed = at::rms_norm(x, {x.size(-1)}, /*weight=*/{}, kFeatureNormEps);
  return torch::relu(normed) + kFeatureFloor;
}

torch::Tensor block_linear_attention(const torch::Tensor& q, const torch::Tensor& k,
                                     const torch::Tensor& v, const torch::Tensor& mixing,
                                     int64_t blocks) {
  const auto b = q.size(0), n = q.size(1), h = q.size(2), d = q.size(3), dv = v.size(3);
  const auto l = n / blocks;
  const auto dtype = reference_compute_dtype(v);
  // [B, N, H, D] -> [B*H*M, L, D]: one block of one head per batch entry of the matmuls.
  auto to_blocks = [&](const torch::Tensor& x) {
    return x.transpose(1, 2).reshape({b * h * blocks, l, x.size(3)});
  };
  auto qf = to_blocks(feature_map(q.to(dtype)));
  auto kf = to_blocks(feature_map(k.to(dtype)));
  // A column of ones after v makes the normalizer z = sum phi(k) ride along with the state S.
  auto v1 = to_blocks(torch::cat({v.to(dtype), torch::ones({b, n, h, 1}, v.options().dtype(dtype))}, -1));
  auto state = torch::bmm(kf.transpose(1, 2), v1);  // [B*H*M, D, Dv+1]: S_j and z_j
  if (blocks > 1 || mixing.defined()) {
    state = torch::matmul(mixing.to(state.scalar_type()),
                          state.view({b * h, blocks, d * (dv + 1)}))
                .view({b * h * blocks, d, dv + 1});
  }
  auto out = torch::bmm(qf, state);  // [B*H*M, L, Dv+1]
  auto result = out.narrow(-1, 0, dv) / (out.narrow(-1, dv, 1) + kNormalizerEps);
  return result.view({b, h, n, dv}).transpose(1, 2).to(v.scalar_type());
}

torch::ScalarType reference_compute_dtype(const torch::Tensor& x) {
  return x.scalar_type() == torch::kFloat64 ? torch::kFloat64 : torch::kFloat32;
}

}  // namespace mhla
