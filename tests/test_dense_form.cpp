// The equations the dense masked kernels (kernels/mhla/dense_block_linear.cu) implement, written
// out in plain LibTorch on full N x N matrices and checked against autograd of the reference ops
// in float64: the forward, and the backward through g = do / (den + eps), gd = -(do . o) /
// (den + eps), dP = g v^T + gd, dA = dP o W, dm_ij = sum_{t in i, s in j} dP_ts A_ts, for
// bidirectional MHLA (and linear attention) and for the causal forms (64-token blocks, s <= t).
#include "attention/attention_op.h"
#include "attention/causal_linear.h"
#include "catch_compat.h"
#include "test_helpers.h"

using namespace mhla;

namespace {

struct DenseGrads {
  torch::Tensor out, dq, dk, dv, dm;
};

// One head: q, k, v [N, D]; w [N, N] the token-level weights; mixing_index [N] the block of each
// token (for dm); returns the output and the gradients the kernels compute.
DenseGrads dense_equations(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                           const torch::Tensor& w, const torch::Tensor& do_, const torch::Tensor& block_of,
                           int64_t blocks) {
  // Feature map and its Jacobian through autograd on q and k alone.
  auto qd = q.detach().requires_grad_(true), kd = k.detach().requires_grad_(true);
  auto qf = feature_map(qd), kf = feature_map(kd);
  auto a = torch::matmul(qf, kf.t());                      // A_ts
  auto p = a * w;                                          // P_ts
  auto den = p.sum(1, true);                               // [N, 1]
  auto out = torch::matmul(p, v) / (den + kNormalizerEps);
  auto g = do_ / (den + kNormalizerEps);
  auto gd = -(do_ * out).sum(1, true) / (den + kNormalizerEps);
  auto dp = torch::matmul(g, v.t()) + gd;                  // dP_ts = g_t . v_s + gd_t
  auto da = dp * w;
  auto dqf = torch::matmul(da, kf), dkf = torch::matmul(da.t(), qf);
  auto dv = torch::matmul(p.t(), g);
  // dm_ij: only where w comes from m_ij (w > 0 marks those entries: causal zeros excluded).
  auto contribution = (dp * a).detach() * (w > 0).to(a.scalar_type());
  auto one_hot = torch::nn::functional::one_hot(block_of, blocks).to(a.scalar_type());  // [N, M]
  auto dm = torch::matmul(one_hot.t(), torch::matmul(contribution, one_hot));
  auto dq = torch::autograd::grad({qf}, {qd}, {dqf.detach()}, true)[0];
  auto dk = torch::autograd::grad({kf}, {kd}, {dkf.detach()})[0];
  return {out.detach(), dq, dk, dv.detach(), dm};
}

}  // namespace

TEST_CASE("attention: the dense-form equations of the cuda_dense kernels match autograd of the references", "[attention]") {
  torch::manual_seed(21);
  auto f64 = torch::TensorOptions().dtype(torch::kFloat64);
  const int64_t n = 150, d = 16;
  for (bool causal : {false, true}) {
    for (bool mixes : {false, true}) {
      INFO((causal ? "causal " : "bidirectional ") << (mixes ? "MHLA" : "linear"));
      // Bidirectional: 5 blocks of 30 tokens; causal: 64-token blocks (3, the last partial).
      const int64_t blocks = causal ? (n + kCausalBlock - 1) / kCausalBlock : 5;
      const int64_t length = causal ? kCausalBlock : n / blocks;
      auto q = torch::randn({1, n, 1, d}, f64), k = torch::randn({1, n, 1, d}, f64);
      auto v = torch::randn({1, n, 1, d}, f64), grad_out = torch::randn({1, n, 1, d}, f64);
      torch::Tensor mixing;
      if (mixes) {
        mixing = torch::rand({blocks, blocks}, f64) + 0.1;
        if (causal) mixing = mixing.tril();
      }
      // Reference output and gradients through autograd.
      auto qr = q.clone().requires_grad_(true), kr = k.clone().requires_grad_(true);
      auto vr = v.clone().requires_grad_(true);
      auto mr = mixes ? mixing.clone().requires_grad_(true) : torch::Tensor();
      torch::Tensor reference;
      if (causal) {
        reference = mixes ? causal_mhla_reference(qr, kr, vr, mr) : causal_linear_attention_reference(qr, kr, vr);
      } else {
        reference = block_linear_attention(qr, kr, vr, mr, mixes ? blocks : 1);
      }
      reference.backward(grad_out);
      // Token-level weights w(t, s) as the kernels form them.
      auto block_of = torch::arange(n, torch::kLong).div(length, "floor");
      auto w = mixes ? mixing.index({block_of.unsqueeze(1), block_of.unsqueeze(0)})
                     : torch::ones({n, n}, f64);
      if (causal) w = w * torch::ones({n, n}, f64).tril();
      auto got = dense_equations(q[0].select(1, 0), k[0].select(1, 0), v[0].select(1, 0), w,
                                 grad_out[0].select(1, 0), block_of, blocks);
      auto head = [](const torch::Tensor& x) { return x[0].select(1, 0); };
      CHECK(test::relative_error(got.out, head(reference.detach())) < 1e-10);
      CHECK(test::relative_error(got.dq, head(qr.grad())) < 1e-9);
      CHECK(test::relative_error(got.dk, head(kr.grad())) < 1e-9);
      CHECK(test::relative_error(got.dv, head(vr.grad())) < 1e-9);
      if (mixes) {
        auto expected = mr.grad();
        if (causal) expected = expected.tril();
        CHECK(test::relative_error(got.dm, expected) < 1e-9);
      }
    }
  }
}
