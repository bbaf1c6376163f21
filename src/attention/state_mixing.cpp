#include "attention/state_mixing.h"

#ifdef MHLA_WITH_CUDA_KERNELS

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "attention/kernel_views.h"
#include "core/determinism.h"
#include "core/environment.h"
#include "core/error.h"
#include "mhla/block_mix_backward.h"
#include "mhla/block_pair_products.h"
#include "models/linear.h"

namespace mhla {

torch::Tensor mix_block_states(const torch::Tensor& weights, const torch::Tensor& states,
                               mhla_kernels::MixPattern pattern, int64_t packed_matrix,
                               bool packed_in) {
  const int64_t blocks = states.size(1);
  if (states.dim() != 3 || weights.dim() != 2 || weights.size(0) != blocks ||
      weights.size(1) != blocks || states.scalar_type() != torch::kFloat32 ||
      weights.scalar_type() != torch::kFloat32 || !states.is_cuda() ||
      weights.device() != states.device()) {
    fail(
        "block state mix: states must be fp32 [BH, blocks, E] on a GPU and weights fp32 "
        "[blocks, blocks] on the same device; got {} {} and {} {}",
        c10::toString(states.scalar_type()), c10::str(states.sizes()),
        c10::toString(weights.scalar_type()), c10::str(weights.sizes()));
  }
  // A packed input row holds packed_matrix / 2 + E - packed_matrix floats for E elements.
  const int64_t elements = states.size(2) + (packed_in ? packed_matrix / 2 : 0);
  if (packed_in && packed_matrix <= 0) {
    fail(
        "block state mix: a packed input needs a packed output of the same matrix part; got a "
        "matrix part of {}",
        packed_matrix);
  }
  // A matrix part of a multiple of 8 keeps packed rows and their fp32 part 16-byte aligned.
  if (packed_matrix < 0 || packed_matrix % 8 != 0 || packed_matrix > elements ||
      (packed_matrix > 0 && (blocks > mhla_kernels::kMaxMixBlocks || elements % 4 != 0))) {
    fail(
        "block state mix: a packed output needs a matrix part of 0 to {} elements, a multiple "
        "of 8, at most {} blocks and rows of a multiple of 4; got {} of {} at {} blocks",
        elements, mhla_kernels::kMaxMixBlocks, packed_matrix, elements, blocks);
  }
  if (blocks > mhla_kernels::kMaxMixBlocks || elements % 4 != 0) {
    // fp32 in, fp32 out: under autocast bmm would run in bf16.
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    return torch::bmm(weights.unsqueeze(0).expand({states.size(0), blocks, blocks}), states);
  }
  auto in = states.contiguous();
  auto w = weights.contiguous();
  auto out = packed_matrix > 0
                 ? torch::empty({in.size(0), blocks, packed_matrix / 2 + elements - packed_matrix},
                                in.options())
                 : torch::empty_like(in);
  mhla_kernels::BlockStateMix a;
  a.in = in.data_ptr<float>();
  a.weights = w.data_ptr<float>();
  a.out = out.data_ptr<float>();
  a.batch_heads = static_cast<int>(in.size(0));
  a.blocks = static_cast<int>(blocks);
  a.elements = elements;
  a.pattern = pattern;
  a.packed_matrix = packed_matrix;
  a.packed_in = packed_in;
  const c10::cuda::CUDAGuard on_device(in.device());
  check_launch(mhla_kernels::block_state_mix(
                   a, c10::cuda::getCurrentCUDAStream(in.device().index()).stream()),
               "block state mix");
  return out;
}

torch::Tensor block_pair_products(const torch::Tensor& x, const torch::Tensor& y, int64_t rows,
                                  int64_t packed_matrix) {
  if (x.dim() != 3 || !x.sizes().equals(y.sizes()) || x.scalar_type() != torch::kFloat32 ||
      y.scalar_type() != torch::kFloat32 || !x.is_contiguous() || !y.is_contiguous() ||
      !x.is_cuda() || x.device() != y.device()) {
    fail(
        "block pair products: x and y must be contiguous fp32 [BH, blocks, E] on one GPU; got {} "
        "{} and {} {}",
        c10::toString(x.scalar_type()), c10::str(x.sizes()), c10::toString(y.scalar_type()),
        c10::str(y.sizes()));
  }
  const int64_t elements = x.size(2) + packed_matrix / 2;  // a packed row's logical elements
  if (packed_matrix < 0 || packed_matrix % 8 != 0 || packed_matrix > elements ||
      elements % 4 != 0 || rows < 1 || rows > std::min<int64_t>(x.size(1), 64)) {
    fail(
        "block pair products: {} rows of [BH, nb, E] = {} with a packed matrix part of {} "
        "elements; need 1 <= rows <= min(nb, 64), a part that is a multiple of 8 and at most the "
        "row's {} elements, and rows of a multiple of 4 elements",
        rows, c10::str(x.sizes()), packed_matrix, elements);
  }
  auto grad = torch::zeros({rows, rows}, x.options());
  mhla_kernels::BlockPairProducts a;
  a.x = x.data_ptr<float>();
  a.y = y.data_ptr<float>();
  a.batch_heads = static_cast<int>(x.size(0));
  a.blocks = static_cast<int>(x.size(1));
  a.rows = static_cast<int>(rows);
  a.elements = elements;
  a.packed_matrix = packed_matrix;
  a.grad = grad.data_ptr<float>();
  const c10::cuda::CUDAGuard on_device(x.device());
  // Deterministic: one part per CTA (or warp), summed here in a fixed order.
  torch::Tensor parts;
  if (deterministic_sums()) {
    const int64_t count = mhla_kernels::block_pair_products_parts(a);
    if (count < 1) fail("block pair products: the kernel cannot be configured for these sizes");
    parts = torch::empty({count, rows, rows}, x.options());
    a.grad_parts = parts.data_ptr<float>();
  }
  check_launch(mhla_kernels::block_pair_products(
                   a, c10::cuda::getCurrentCUDAStream(x.device().index()).stream()),
               "block pair products");
  if (parts.defined()) column_sums_into(parts.view({parts.size(0), -1}), grad.view({-1}));
  return grad;
}

std::pair<torch::Tensor, torch::Tensor> mix_block_states_backward(
    const torch::Tensor& mixing, const torch::Tensor& grad_mixed, const torch::Tensor& states,
    int64_t packed_matrix, bool packed_inputs, torch::Tensor zeroed_dm,
    torch::Tensor* mixing_parts) {
  static const bool fused = environment_switch("MHLA_FUSED_MIX_BACKWARD", true);
  const int64_t blocks = states.size(1);
  // Logical elements per state (a packed row holds packed_matrix / 2 fewer floats).
  const int64_t elements = states.size(2) + (packed_inputs ? packed_matrix / 2 : 0);
  if (packed_matrix < 0 || packed_matrix % 8 != 0 || packed_matrix > elements ||
      (packed_inputs && packed_matrix == 0)) {
    fail(
        "block mix backward: a packed d states needs a matrix part of 0 to {} elements, a "
        "multiple of 8 (above 0 for packed inputs); got {}",
        elements, packed_matrix);
  }
  if (!fused || !mhla_kernels::block_mix_backward_supported(static_cast<int>(blocks), elements) ||
      !mhla_kernels::block_mix_backward_takes_packed(static_cast<int>(blocks),
                                                     packed_inputs ? packed_matrix : 0)) {
    // The transposed mix writes each element once; the pair products sum their parts in order
    // under train.deterministic.
    return {mix_block_states(mixing.t(), grad_mixed, mhla_kernels::MixPattern::dense, packed_matrix,
                             packed_inputs),
            block_pair_products(grad_mixed, states, blocks, packed_inputs ? packed_matrix : 0)};
  }
  if (grad_mixed.dim() != 3 || !grad_mixed.sizes().equals(states.sizes()) ||
      grad_mixed.scalar_type() != torch::kFloat32 || states.scalar_type() != torch::kFloat32 ||
      !grad_mixed.is_contiguous() || !states.is_contiguous() || !states.is_cuda() ||
      grad_mixed.device() != states.device() || mixing.dim() != 2 || mixing.size(0) != blocks ||
      mixing.size(1) != blocks || mixing.scalar_type() != torch::kFloat32 ||
      mixing.device() != states.device()) {
    fail(
        "block mix backward: d mixed and states must be contiguous fp32 [BH, blocks, E] on one GPU "
        "and the mixing matrix fp32 [blocks, blocks] there; got {} {}, {} {} and {} {}",
        c10::toString(grad_mixed.scalar_type()), c10::str(grad_mixed.sizes()),
        c10::toString(states.scalar_type()), c10::str(states.sizes()),
        c10::toString(mixing.scalar_type()), c10::str(mixing.sizes()));
  }
  auto weights = mixing.contiguous();
  auto grad_states =
      packed_matrix > 0
          ? torch::empty({states.size(0), blocks, packed_matrix / 2 + elements - packed_matrix},
                         states.options())
          : torch::empty_like(states);
  auto grad_mixing =
      zeroed_dm.defined() ? zeroed_dm : torch::zeros({blocks, blocks}, states.options());
  if (!grad_mixing.sizes().equals({blocks, blocks}) ||
      grad_mixing.scalar_type() != torch::kFloat32 || !grad_mixing.is_contiguous() ||
      grad_mixing.device() != states.device()) {
    fail(
        "block mix backward: a zeroed d mixing must be contiguous fp32 [{}, {}] beside the states; "
        "got {} {}",
        blocks, blocks, c10::toString(grad_mixing.scalar_type()), c10::str(grad_mixing.sizes()));
  }
  mhla_kernels::BlockMixBackward a;
  a.batch_heads = static_cast<int>(states.size(0));
  a.blocks = static_cast<int>(blocks);
  a.elements = elements;
  a.packed_matrix = packed_matrix;
  a.packed_inputs_matrix = packed_inputs ? packed_matrix : 0;
  // Deterministic: one part per CTA, summed in a fixed order (core/determinism.h) here or, when
  // the caller asks for them, by the caller.
  torch::Tensor parts;
  if (deterministic_sums()) {
    const int64_t count = mhla_kernels::block_mix_backward_parts(a);
    if (count < 0) fail("block mix backward: the kernel cannot be configured on this GPU");
    parts = torch::empty({count, blocks, blocks}, states.options());
    a.grad_mixing_parts = parts.data_ptr<float>();
  }
  a.grad_mixed = grad_mixed.data_ptr<float>();
  a.states = states.data_ptr<float>();
  a.mixing = weights.data_ptr<float>();
  a.grad_states = grad_states.data_ptr<float>();
  a.grad_mixing = grad_mixing.data_ptr<float>();
  const c10::cuda::CUDAGuard on_device(states.device());
  check_launch(mhla_kernels::block_mix_backward(
                   a, c10::cuda::getCurrentCUDAStream(states.device().index()).stream()),
               "block mix backward");
  if (parts.defined()) {
    if (mixing_parts != nullptr) {
      *mixing_parts = parts;
    } else {
      column_sums_into(parts.view({parts.size(0), -1}), grad_mixing.view({-1}));
    }
  }
  return {grad_states, grad_mixing};
}

}  // namespace mhla

#endif  // MHLA_WITH_CUDA_KERNELS
