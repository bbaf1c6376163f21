#include "attention/causal_block_linear_cuda.h"

#ifdef MHLA_WITH_CUDA_KERNELS

#include <algorithm>
#include <cstring>
#include <tuple>

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "attention/causal_linear.h"
#include "attention/kernel_views.h"
#include "attention/state_mixing.h"
#include "core/determinism.h"
#include "core/environment.h"
#include "core/error.h"
#include "core/kernel_dtype.h"
#include "mhla/block_mix_backward.h"
#include "mhla/causal_block_linear.h"
#include "models/linear.h"

namespace mhla {
namespace {

namespace kernels = mhla_kernels;

kernels::CausalBlockLinearShape causal_shape_of(const torch::Tensor& q,
                                                const torch::Tensor& mixing) {
  return {static_cast<int>(q.size(0)), static_cast<int>(q.size(1)), static_cast<int>(q.size(2)),
          static_cast<int>(q.size(3)), mixing.numel() > 0 ? static_cast<int>(mixing.size(0)) : 1};
}

// Where the prefix mixing runs. Unset: as a matrix product ("GEMM": the state-mix kernel of
// state_mixing.h) inside the trained length, the kernels' prefix sweep past it. The products cost
// O(blocks^2) per state element, the sweep O(blocks x M). On the H200 at B*T = 32,768, H = 8,
// D = 128, M = 16 the products won up to 32 blocks until session 21 (2.73 against 2.84 ms at 32
// blocks, session 8); session 22's sweeps (register rings, the trained pairs summed in the
// backward sweep) took MHLA at T = 2,048 (32 blocks) from 1.71 ms by products to 1.52 by the
// sweeps before the pairs moved in. MHLA_CAUSAL_MIX_GEMM=1 / =0 forces either at every length.
// Read on every call (the tests run each path in one process).
bool mix_by_gemm(int64_t blocks, int64_t trained_blocks) {
  const int choice = [] {
    const char* value = std::getenv("MHLA_CAUSAL_MIX_GEMM");
    if (value == nullptr) return -1;
    if (std::strcmp(value, "0") == 0) return 0;
    return std::strcmp(value, "1") == 0 ? 1 : -1;
  }();
  return choice < 0 ? blocks <= trained_blocks : choice == 1;
}

// The strictly lower weights w_ij (j < i) of `blocks` blocks: the learned matrix's corner inside
// the trained length, the policy's expansion past it.
torch::Tensor strict_weights(const torch::Tensor& mixing, int64_t blocks) {
  if (blocks <= mixing.size(0)) return mixing.narrow(0, 0, blocks).narrow(1, 0, blocks).tril(-1);
  return causal_mixing_matrix(mixing, blocks).tril(-1);
}

// Saves q, k, v, the output, the mixing matrix (empty: linear attention) and the fp32 block
// states and prefixes. The prefix mixing and its backward are GEMMs here or the kernels' sweeps
// (mix_by_gemm; linear attention always sweeps: a running sum). The mixing gradient of the rows
// inside the trained length is a GEMM here in both cases (see the kernel header); past it the
// sweep adds the sliding row's, or the GEMM path maps the expanded matrix's gradient back through
// causal_mixing_matrix.
class CausalBlockLinearFunction : public torch::autograd::Function<CausalBlockLinearFunction> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& q_in,
                               const torch::Tensor& k_in, const torch::Tensor& v_in,
                               const torch::Tensor& mixing_in) {
    const auto dtype = v_in.scalar_type();
    auto q = readable(q_in, dtype), k = readable(k_in, dtype), v = readable(v_in, dtype);
    const bool mixes = mixing_in.numel() > 0;
    auto mixing = mixes ? mixing_in.detach().to(torch::kFloat32).contiguous() : mixing_in;
    const auto shape = causal_shape_of(q, mixing);
    const int64_t blocks = kernels::causal_blocks(shape.tokens);
    const int64_t batch_heads = q.size(0) * q.size(2), d = q.size(3);
    const bool gemm_mix = mixes && mix_by_gemm(blocks, mixing.size(0));
    kernels::CausalBlockLinearForward a;
    // MHLA_CAUSAL_PACKED_STATES=1: where the prefix is a sweep, the states are packed as the
    // prefixes are (the sweeps and the pair products read them; the GEMM mix and cuBLAS take
    // fp32), and so are their gradients. Half the bytes, but not faster: the sweeps are bound by
    // their instructions, and the packed writes cost the states pass (session 22, MHLA at
    // T = 8,192: 1.39 ms fp32 against 1.42 packed). Off by default; read on every call.
    const bool pack_states = environment_switch("MHLA_CAUSAL_PACKED_STATES", false);
    a.packed_states =
        pack_states && !gemm_mix && kernels::causal_prefix_packed(kernel_dtype(dtype));
    auto states = torch::empty(
        {batch_heads, blocks, kernels::causal_prefix_floats(static_cast<int>(d), a.packed_states)},
        q.options().dtype(torch::kFloat32));
    auto out = torch::empty(q.sizes(), v.options().memory_format(torch::MemoryFormat::Contiguous));
    a.shape = shape;
    a.dtype = kernel_dtype(dtype);
    a.q = view_of(q), a.k = view_of(k), a.v = view_of(v);
    a.mixing = mixes ? mixing.data_ptr<float>() : nullptr;
    a.out = out.data_ptr();
    a.states = states.data_ptr<float>();
    const c10::cuda::CUDAGuard on_device(q.device());
    auto stream = c10::cuda::getCurrentCUDAStream(q.device().index()).stream();
    a.passes = kernels::kCausalStatesPass;
    check_launch(kernels::causal_block_linear_forward(a, stream), "causal block linear states");
    // The prefixes are read only as bf16 tiles and fp32 z: packed for bf16 (see the header).
    a.packed_prefix = kernels::causal_prefix_packed(a.dtype);
    torch::Tensor prefix;
    if (gemm_mix) {
      // Past the state-mix kernel's blocks (only with MHLA_CAUSAL_MIX_GEMM=1) cuBLAS mixes, in
      // fp32.
      if (blocks > kernels::kMaxMixBlocks) a.packed_prefix = false;
      prefix = mix_block_states(strict_weights(mixing, blocks), states, kernels::MixPattern::lower,
                                a.packed_prefix ? d * d : 0);
    } else {
      prefix = torch::empty({batch_heads, blocks,
                             kernels::causal_prefix_floats(static_cast<int>(d), a.packed_prefix)},
                            states.options());
      a.prefix = prefix.data_ptr<float>();
      a.passes = kernels::kCausalPrefixPass;
      check_launch(kernels::causal_block_linear_forward(a, stream), "causal block linear prefix");
    }
    a.prefix = prefix.data_ptr<float>();
    a.passes = kernels::kCausalOutputPass;
    check_launch(kernels::causal_block_linear_forward(a, stream), "causal block linear output");
    ctx->save_for_backward({q, k, v, out, mixing, states, prefix});
    remember_input_dtypes(ctx, q_in, k_in);
    return out;
  }

  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    auto saved = ctx->get_saved_variables();
    auto q = saved[0], k = saved[1], v = saved[2], out = saved[3], mixing = saved[4];
    auto states = saved[5], prefix = saved[6];
    const bool mixes = mixing.numel() > 0;
    const int64_t blocks = states.size(1), d = q.size(3);
    const bool by_gemm = mixes && mix_by_gemm(blocks, mixing.size(0));
    // Ordered sums (train.deterministic): inside the trained length the mixing gradient is the
    // query pass's diagonal parts (summed below) and the pair products of the fused mix backward
    // (up to kMixBackwardMaxBlocks) or of the pair-products kernel (beyond), which sum their own
    // parts; past it the sweeps and the expansion's gradient add with atomics.
    torch::Tensor diagonal_parts;
    if (mixes && deterministic_sums()) {
      if (!by_gemm || blocks > mixing.size(0)) {
        require_ordered_sums(fmt::format(
            "the causal MHLA backward's mixing gradient at {} blocks of 64 tokens (trained on {}; "
            "ordered sums need the trained length or less)",
            blocks, mixing.size(0)));
      }
      diagonal_parts = torch::empty({states.size(0), blocks}, mixing.options());
    }
    // As the forward pass stored them (packed sets are shorter than D * D + D floats per block).
    const bool packed_prefix = prefix.size(2) != d * d + d;
    const bool packed_states = states.size(2) != d * d + d;
    auto grad_out = readable(grads[0], v.scalar_type());
    auto contiguous = v.options().memory_format(torch::MemoryFormat::Contiguous);
    auto dq = torch::empty(q.sizes(), contiguous), dk = torch::empty(q.sizes(), contiguous);
    auto dv = torch::empty(q.sizes(), contiguous);
    // dP_i is packed where the states are (the sweep path: only sums in fp32 read it).
    auto grad_prefix = torch::empty_like(states);
    torch::Tensor dmixing;
    kernels::CausalBlockLinearBackward a;
    a.shape = causal_shape_of(q, mixing);
    a.dtype = kernel_dtype(v.scalar_type());
    a.q = view_of(q), a.k = view_of(k), a.v = view_of(v), a.out = view_of(out);
    a.grad_out = view_of(grad_out);
    if (mixes) {
      dmixing = torch::empty_like(mixing);
      a.mixing = mixing.data_ptr<float>();
      a.grad_mixing = dmixing.data_ptr<float>();
      if (diagonal_parts.defined()) a.diagonal_parts = diagonal_parts.data_ptr<float>();
    }
    a.states = states.data_ptr<float>();
    a.prefix = prefix.data_ptr<float>();
    a.packed_prefix = packed_prefix;
    a.packed_states = packed_states;
    a.packed_grad_prefix = packed_states;
    a.grad_q = dq.data_ptr(), a.grad_k = dk.data_ptr(), a.grad_v = dv.data_ptr();
    a.grad_prefix = grad_prefix.data_ptr<float>();
    const c10::cuda::CUDAGuard on_device(q.device());
    auto stream = c10::cuda::getCurrentCUDAStream(q.device().index()).stream();
    a.passes = kernels::kCausalQueryPass;
    check_launch(kernels::causal_block_linear_backward(a, stream),
                 "causal block linear query pass");
    torch::Tensor grad_states, pairs;  // pairs: sum <dP_i, S_j> for every i, j < blocks
    if (by_gemm && blocks <= kernels::kMixBackwardMaxBlocks) {
      // dS_j = sum_i w_ij dP_i and the pair products in one pass over the states.
      std::tie(grad_states, pairs) =
          mix_block_states_backward(strict_weights(mixing, blocks), grad_prefix, states);
    } else if (by_gemm) {
      grad_states = mix_block_states(strict_weights(mixing, blocks).t(), grad_prefix,
                                     kernels::MixPattern::upper);
    } else {
      // The key pass reads dS only as bf16 tiles and fp32 dz: the sweeps write it packed too.
      a.packed_grad_states = a.packed_prefix;
      grad_states =
          torch::empty({states.size(0), blocks,
                        kernels::causal_prefix_floats(static_cast<int>(d), a.packed_grad_states)},
                       states.options());
      a.grad_states = grad_states.data_ptr<float>();
      a.passes = kernels::kCausalPrefixPass;
      check_launch(kernels::causal_block_linear_backward(a, stream),
                   "causal block linear prefix backward");
    }
    a.grad_states = grad_states.data_ptr<float>();
    a.passes = kernels::kCausalKeyPass;
    check_launch(kernels::causal_block_linear_backward(a, stream), "causal block linear key pass");
    if (mixes) {
      c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
      const int64_t trained = mixing.size(0);
      if (diagonal_parts.defined()) {  // dm_ii: the parts over batch and heads, in order
        auto diagonal = torch::empty({blocks}, mixing.options());
        column_sums_into(diagonal_parts, diagonal);
        dmixing.diagonal().narrow(0, 0, blocks).add_(diagonal);
      }
      if (by_gemm && blocks > trained) {
        // dw_ij = sum <dP_i, S_j> for every j < i, mapped back to the learned matrix through the
        // policy's expansion (its autograd graph, rebuilt on a detached copy).
        auto dw = (pairs.defined() ? pairs
                   : blocks <= 64  ? block_pair_products(grad_prefix, states, blocks)
                                   : torch::bmm(grad_prefix, states.transpose(1, 2)).sum(0))
                      .tril(-1);
        torch::AutoGradMode grad_on(true);
        auto leaf = mixing.detach().requires_grad_(true);
        auto expanded = strict_weights(leaf, blocks);
        dmixing.add_(torch::autograd::grad({expanded}, {leaf}, {dw})[0]);
      } else {
        // The sweep added the sliding row's part; dm_ij += sum <dP_i, S_j> for j < i inside the
        // trained length.
        const int64_t dense = std::min<int64_t>(blocks, trained);
        if (!pairs.defined()) {
          pairs = block_pair_products(grad_prefix, states, dense, packed_states ? d * d : 0);
        }
        dmixing.narrow(0, 0, dense).narrow(1, 0, dense).add_(pairs.tril(-1));
      }
    }
    const auto [q_type, k_type] = input_dtypes(ctx);
    return {dq.to(q_type), dk.to(k_type), dv, dmixing};
  }
};

bool kernels_take(const torch::Tensor& q, const torch::Tensor& v, const torch::Tensor& mixing) {
  const auto dtype = kernel_dtype_of(v.scalar_type());
  if (!dtype || (mixing.defined() && mixing.size(0) > 64)) return false;
  const auto empty = torch::Tensor();
  return kernels::causal_block_linear_supported(
      causal_shape_of(q, mixing.defined() ? mixing : empty), *dtype);
}

}  // namespace

torch::Tensor causal_block_linear_cuda(const torch::Tensor& q, const torch::Tensor& k,
                                       const torch::Tensor& v, const torch::Tensor& mixing) {
  const char* op = mixing.defined() ? "mhla" : "linear";
  if (q.dim() != 4 || !q.sizes().equals(k.sizes()) || !q.sizes().equals(v.sizes())) {
    fail("{} (cuda, causal): q, k, v must have the same shape [B, T, H, D]; got {}, {}, {}", op,
         c10::str(q.sizes()), c10::str(k.sizes()), c10::str(v.sizes()));
  }
  if (!q.is_cuda() || !k.is_cuda() || !v.is_cuda())
    fail("{} (cuda, causal): inputs must be on a CUDA device", op);
  check_same_device(fmt::format("{} (cuda, causal)", op), q,
                    {{"k", k}, {"v", v}, {"the mixing matrix", mixing}});
  if (mixing.defined() && (mixing.dim() != 2 || mixing.size(0) != mixing.size(1))) {
    fail("mhla (cuda, causal): the mixing matrix must be square, got {}", c10::str(mixing.sizes()));
  }
  if (!kernels_take(q, v, mixing)) {
    return mixing.defined() ? causal_mhla_reference(q, k, v, mixing)
                            : causal_linear_attention_reference(q, k, v);
  }
  // Autograd functions take defined tensors only: an empty one means "no mixing".
  return CausalBlockLinearFunction::apply(
      q, k, v, mixing.defined() ? mixing : torch::empty({0}, q.options().dtype(torch::kFloat32)));
}

}  // namespace mhla

#endif  // MHLA_WITH_CUDA_KERNELS
