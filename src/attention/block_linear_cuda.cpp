#include "attention/block_linear_cuda.h"

#ifdef MHLA_WITH_CUDA_KERNELS

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "attention/causal_block_linear_cuda.h"
#include "attention/causal_linear.h"
#include "attention/kernel_views.h"
#include "attention/state_mixing.h"
#include "core/determinism.h"
#include "core/environment.h"
#include "core/error.h"
#include "core/kernel_dtype.h"
#include "linear_attn/linear_attn.h"
#include "mhla/block_fragment_passes.h"
#include "mhla/block_linear_attention.h"
#include "mhla/cluster_block_linear.h"
#include "mhla/dense_block_linear.h"
#include "mhla/resident_block_linear.h"
#include "mhla/resident_state_backward.h"
#include "mhla/resident_warpgroup_backward.h"
#include "mhla/sequence_state_forward.h"
#include "models/linear.h"

namespace mhla {
namespace {

namespace kernels = mhla_kernels;

void check_inputs(const char* op, const torch::Tensor& q, const torch::Tensor& k,
                  const torch::Tensor& v, int64_t blocks) {
  if (q.dim() != 4 || !q.sizes().equals(k.sizes()) || !q.sizes().equals(v.sizes())) {
    fail("{} (cuda): q, k, v must have the same shape [B, N, H, D]; got {}, {}, {}", op,
         c10::str(q.sizes()), c10::str(k.sizes()), c10::str(v.sizes()));
  }
  if (!q.is_cuda() || !k.is_cuda() || !v.is_cuda())
    fail("{} (cuda): inputs must be on a CUDA device", op);
  const auto d = q.size(3);
  if (d != 32 && d != 64 && d != 128)
    fail("{} (cuda): head dim {} is not one of 32, 64, 128", op, d);
  if (blocks < 1 || blocks > 64 || q.size(1) % blocks != 0) {
    fail("{} (cuda): {} blocks for N = {} (blocks in [1, 64] dividing N)", op, blocks, q.size(1));
  }
  if (q.size(0) * q.size(2) > 65535)
    fail("{} (cuda): B*H = {} exceeds 65535", op, q.size(0) * q.size(2));
  check_same_device(fmt::format("{} (cuda)", op), q, {{"k", k}, {"v", v}});
}

// Causal cuda_dense falls back to the reference for what the kernels do not take, so only
// the shapes and the device are required here.
void check_causal_inputs(const char* op, const torch::Tensor& q, const torch::Tensor& k,
                         const torch::Tensor& v) {
  if (q.dim() != 4 || !q.sizes().equals(k.sizes()) || !q.sizes().equals(v.sizes())) {
    fail("{} (cuda_dense): q, k, v must have the same shape [B, T, H, D]; got {}, {}, {}", op,
         c10::str(q.sizes()), c10::str(k.sizes()), c10::str(v.sizes()));
  }
  if (!q.is_cuda() || !k.is_cuda() || !v.is_cuda())
    fail("{} (cuda_dense): inputs must be on a CUDA device", op);
}

kernels::BlockLinearShape shape_of(const torch::Tensor& q, int64_t blocks) {
  return {static_cast<int>(q.size(0)), static_cast<int>(q.size(1)), static_cast<int>(q.size(2)),
          static_cast<int>(q.size(3)), static_cast<int>(blocks)};
}

// A flat set of states as [B*H, blocks, D*D + D].
torch::Tensor by_block(const torch::Tensor& states, const torch::Tensor& q, int64_t blocks) {
  return states.view({q.size(0) * q.size(2), blocks, -1});
}

// Whether MHLA keeps its mixed states S' and their gradient dS as packed sets (bf16 matrices):
// the fragment passes that read them round them to bf16 anyway, so results do not change and
// two reads and two writes of the sets take half the bytes. bf16 inputs whose four passes run
// on fragments; MHLA_PACKED_STATE_SETS=0 keeps them fp32 for A/B runs.
bool packs_state_sets(const kernels::BlockLinearShape& shape, kernels::DType dtype) {
  static const bool enabled = environment_switch("MHLA_PACKED_STATE_SETS", true);
  return enabled && dtype == kernels::DType::bf16 &&
         kernels::fragment_passes_in_use(dtype, shape.head_dim);
}

// Whether MHLA's block states S and their gradients dS' are packed sets too, where one CTA owns
// each state (blocks of at most one 256-token chunk). The states pass writes S and the query pass
// dS' as bf16 matrices (S' and dS come out rounded to bf16 anyway); the state mix and the mix
// backward read them: at B = 64, N = 1,024, H = 6, D = 64, M = 16 that is 250 of about 750 MB
// of state traffic per forward and backward (0.468 -> 0.435 ms, session 27).
// MHLA_PACKED_BLOCK_STATES=0 keeps them fp32 (A/B runs).
bool packs_block_states(const kernels::BlockLinearShape& shape, kernels::DType dtype) {
  static const bool enabled = environment_switch("MHLA_PACKED_BLOCK_STATES", true);
  return enabled && packs_state_sets(shape, dtype) && kernels::block_states_packable(shape, dtype);
}

// Whether linear attention's passes read packed copies of S and dS (linear_attn.h); its fp32
// sets get room for them behind. MHLA_PACKED_STATE_SETS=0 keeps them fp32 (A/B runs).
bool linear_packs_states(const kernels::BlockLinearShape& shape, kernels::DType dtype) {
  return packs_state_sets(shape, dtype) &&
         kernels::linear_attention_packs_states(shape.tokens, shape.head_dim, dtype);
}

size_t linear_packed_floats(const kernels::BlockLinearShape& shape) {
  return kernels::linear_attention_packed_floats(shape.batch, shape.heads, shape.head_dim);
}

// With train.deterministic, where a block spans several 256-token chunks whose CTAs would add
// into its state (and dS') with atomics: the workspace in which each chunk stores its part, summed
// in chunk order by the kernels (BlockLinearForward::chunk_parts). Undefined otherwise.
torch::Tensor ordered_chunk_sums_workspace(const kernels::BlockLinearShape& shape,
                                           const torch::Tensor& like) {
  if (!deterministic_sums() || !kernels::block_states_shared_by_chunks(shape)) return {};
  const auto floats = static_cast<int64_t>(kernels::block_linear_chunk_parts_floats(shape));
  return torch::empty({floats}, like.options().dtype(torch::kFloat32));
}

float* data_or_null(const torch::Tensor& t) {
  return t.defined() ? t.data_ptr<float>() : nullptr;
}

// How MHLA's forward runs on the state kernels: `automatic` takes the one-kernel sequence forward
// (sequence_state_forward.h) where it fits, unless MHLA_SEQUENCE_FORWARD=0 (A/B runs); `passes`
// runs the states pass, the state mix and the output pass; `sequence` the one kernel (an error
// where it does not fit).
enum class StatesForward : int64_t { automatic = 0, passes = 1, sequence = 2 };

// The arguments of the sequence forward for these inputs (outputs left unset).
kernels::SequenceStateForward sequence_forward_args(const torch::Tensor& q, const torch::Tensor& k,
                                                    const torch::Tensor& v,
                                                    const torch::Tensor& mixing, int64_t blocks) {
  kernels::SequenceStateForward a;
  a.shape = shape_of(q, blocks);
  a.dtype = kernel_dtype(v.scalar_type());
  a.q = view_of(q), a.k = view_of(k), a.v = view_of(v);
  a.mixing = mixing.data_ptr<float>();
  return a;
}

// Whether the sequence forward computes MHLA on these inputs: its shapes (bf16, D = 64, N = 64 M,
// M <= 16), with S and S' kept as packed sets for the backward passes that read them.
bool sequence_forward_fits(const kernels::BlockLinearShape& shape, kernels::DType dtype) {
  return kernels::sequence_state_forward_supported(shape, dtype) &&
         packs_block_states(shape, dtype);
}

bool sequence_forward_wanted(StatesForward form) {
  static const bool enabled = environment_switch("MHLA_SEQUENCE_FORWARD", true);
  return form == StatesForward::sequence || (form == StatesForward::automatic && enabled);
}

// One autograd function for both ops: without a mixing matrix it calls the linear-attention
// kernels, with one the MHLA kernels. Saves q, k, v, the output, the fp32 block states and (MHLA)
// the mixed states.
class BlockLinearFunction : public torch::autograd::Function<BlockLinearFunction> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& q_in,
                               const torch::Tensor& k_in, const torch::Tensor& v_in,
                               const torch::Tensor& mixing_in, int64_t blocks,
                               int64_t forward_form = 0) {
    const auto dtype = v_in.scalar_type();
    auto q = readable(q_in, dtype), k = readable(k_in, dtype), v = readable(v_in, dtype);
    const bool mixes = mixing_in.numel() > 0;  // an empty tensor stands for "no mixing"
    auto mixing = mixes ? mixing_in.detach().to(torch::kFloat32).contiguous() : mixing_in;
    const auto shape = shape_of(q, blocks);
    const auto chunk_parts = ordered_chunk_sums_workspace(shape, q);
    auto floats = q.options().dtype(torch::kFloat32);
    const bool packed_states = mixes && packs_block_states(shape, kernel_dtype(dtype));
    // Linear attention on its pipelined passes: S in fp32 (the chunks' sums), then a packed copy
    // behind it for the passes that read S.
    const bool linear_packs = !mixes && linear_packs_states(shape, kernel_dtype(dtype));
    auto states = torch::empty(
        {static_cast<int64_t>(packed_states
                                  ? kernels::block_linear_packed_floats(shape)
                                  : kernels::block_linear_state_floats(shape) +
                                        (linear_packs ? linear_packed_floats(shape) : 0))},
        floats);
    auto mixed = states;  // MHLA: replaced by the mixed states below
    auto out = torch::empty(q.sizes(), v.options().memory_format(torch::MemoryFormat::Contiguous));
    const c10::cuda::CUDAGuard on_device(q.device());  // launch on the inputs' GPU
    auto stream = c10::cuda::getCurrentCUDAStream(q.device().index()).stream();
    const auto form = static_cast<StatesForward>(forward_form);
    std::optional<kernels::SequenceStateForward> sequence;
    if (mixes && sequence_forward_wanted(form) &&
        sequence_forward_fits(shape, kernel_dtype(dtype))) {
      sequence = sequence_forward_args(q, k, v, mixing, blocks);
      if (!kernels::sequence_state_forward_takes(*sequence)) sequence.reset();
    }
    if (mixes && form == StatesForward::sequence && !sequence) {
      fail("mhla (cuda): the sequence forward does not take q {} ({}) with {} blocks",
           c10::str(q.sizes()), c10::toString(dtype), blocks);
    }
    if (sequence) {
      // States, mix and output in one kernel; S and S' still go out (packed) for the backward.
      mixed =
          torch::empty({static_cast<int64_t>(kernels::block_linear_packed_floats(shape))}, floats);
      sequence->out = out.data_ptr();
      sequence->states = states.data_ptr<float>();
      sequence->mixed = mixed.data_ptr<float>();
      check_launch(kernels::sequence_state_forward(*sequence, stream), "mhla forward (sequence)");
      ctx->saved_data["packed_mixed"] = true;
    } else if (mixes) {
      // States and output by the kernels, the mix between them by the state-mix kernel of
      // src/attention/state_mixing.h (the kernels' own mixing pass, latency-bound, took 125 us
      // at B = 64, N = 1,024, H = 6, D = 64, M = 16 on the H200).
      kernels::BlockLinearForward a;
      a.shape = shape;
      a.dtype = kernel_dtype(dtype);
      a.q = view_of(q), a.k = view_of(k), a.v = view_of(v);
      a.mixing = mixing.data_ptr<float>();
      a.out = out.data_ptr();
      a.states = states.data_ptr<float>();
      a.packed_states = packed_states;
      a.chunk_parts = data_or_null(chunk_parts);
      a.passes = kernels::kBlockStatesPass;
      check_launch(kernels::block_linear_forward(a, stream), "mhla forward (states)");
      a.packed_states = false;
      a.packed_mixed = packs_state_sets(shape, a.dtype);
      const int64_t d = q.size(3);
      mixed = mix_block_states(mixing, by_block(states, q, blocks), kernels::MixPattern::dense,
                               a.packed_mixed ? d * d : 0, packed_states)
                  .view({-1});
      ctx->saved_data["packed_mixed"] = a.packed_mixed;
      a.mixed = mixed.data_ptr<float>();
      a.passes = kernels::kBlockOutputPass;
      check_launch(kernels::block_linear_forward(a, stream), "mhla forward (output)");
    } else {
      kernels::LinearAttentionForward a;
      a.batch = shape.batch, a.tokens = shape.tokens, a.heads = shape.heads,
      a.head_dim = shape.head_dim;
      a.dtype = kernel_dtype(dtype);
      a.q = view_of(q), a.k = view_of(k), a.v = view_of(v);
      a.out = out.data_ptr();
      a.state = states.data_ptr<float>();
      a.chunk_parts = data_or_null(chunk_parts);
      if (linear_packs) a.packed_state = a.state + kernels::block_linear_state_floats(shape);
      check_launch(kernels::linear_attention_forward(a, stream), "linear attention forward");
    }
    ctx->save_for_backward({q, k, v, out, mixing, states, mixed});
    ctx->saved_data["blocks"] = blocks;
    ctx->saved_data["packed_states"] = packed_states;
    remember_input_dtypes(ctx, q_in, k_in);
    return out;
  }

  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    auto saved = ctx->get_saved_variables();
    auto q = saved[0], k = saved[1], v = saved[2], out = saved[3], mixing = saved[4];
    auto states = saved[5], mixed = saved[6];
    const int64_t blocks = ctx->saved_data["blocks"].toInt();
    const bool mixes = mixing.numel() > 0;
    // The forward's choices.
    const bool packed = mixes && ctx->saved_data["packed_mixed"].toBool();
    const bool packed_states = ctx->saved_data["packed_states"].toBool();
    auto grad_out = readable(grads[0], v.scalar_type());
    const auto shape = shape_of(q, blocks);
    auto contiguous = v.options().memory_format(torch::MemoryFormat::Contiguous);
    auto dq = torch::empty(q.sizes(), contiguous), dk = torch::empty(q.sizes(), contiguous);
    auto dv = torch::empty(q.sizes(), contiguous);
    auto grad_mixed = torch::empty_like(states);  // dS': packed where S is
    const auto chunk_parts = ordered_chunk_sums_workspace(shape, q);
    const c10::cuda::CUDAGuard on_device(q.device());  // launch on the inputs' GPU
    auto stream = c10::cuda::getCurrentCUDAStream(q.device().index()).stream();
    torch::Tensor dmixing;
    if (mixes) {
      // Query pass (dS'_i), then dS_j = sum_i m_ij dS'_i and dm_ij = sum <dS'_i, S_j> (one
      // fused pass over the states: state_mixing.h), then the key pass.
      kernels::BlockLinearBackward a;
      a.shape = shape;
      a.dtype = kernel_dtype(v.scalar_type());
      a.q = view_of(q), a.k = view_of(k), a.v = view_of(v), a.out = view_of(out);
      a.grad_out = view_of(grad_out);
      a.mixing = mixing.data_ptr<float>();
      a.states = states.data_ptr<float>();
      a.mixed = mixed.data_ptr<float>();
      a.grad_q = dq.data_ptr(), a.grad_k = dk.data_ptr(), a.grad_v = dv.data_ptr();
      a.grad_mixed = grad_mixed.data_ptr<float>();
      a.packed_mixed = packed;
      a.packed_grad_mixed = packed_states;
      a.passes = kernels::kBlockQueryPass;
      auto zeroed_dm = torch::empty({blocks, blocks}, mixing.options());
      a.zero_on_entry = zeroed_dm.data_ptr<float>();
      a.zero_floats = static_cast<int>(blocks * blocks);
      a.chunk_parts = data_or_null(chunk_parts);
      check_launch(kernels::block_linear_backward(a, stream), "mhla backward (query pass)");
      a.zero_on_entry = nullptr;
      const auto grad_mixed_blocks = by_block(grad_mixed, q, blocks);
      torch::Tensor grad_states;
      const int64_t d = q.size(3);
      torch::Tensor dm_parts;  // deterministic sums: summed after the key pass
      std::tie(grad_states, dmixing) =
          mix_block_states_backward(mixing, grad_mixed_blocks, by_block(states, q, blocks),
                                    packed ? d * d : 0, packed_states, zeroed_dm, &dm_parts);
      a.grad_states = grad_states.data_ptr<float>();
      a.packed_grad_states = packed;
      a.passes = kernels::kBlockKeyPass;
      check_launch(kernels::block_linear_backward(a, stream), "mhla backward (key pass)");
      if (dm_parts.defined())
        column_sums_into(dm_parts.view({dm_parts.size(0), -1}), dmixing.view({-1}));
    } else {
      kernels::LinearAttentionBackward a;
      a.batch = shape.batch, a.tokens = shape.tokens, a.heads = shape.heads,
      a.head_dim = shape.head_dim;
      a.dtype = kernel_dtype(v.scalar_type());
      a.q = view_of(q), a.k = view_of(k), a.v = view_of(v), a.out = view_of(out);
      a.grad_out = view_of(grad_out);
      a.state = states.data_ptr<float>();
      a.grad_q = dq.data_ptr(), a.grad_k = dk.data_ptr(), a.grad_v = dv.data_ptr();
      a.grad_state = grad_mixed.data_ptr<float>();
      a.chunk_parts = data_or_null(chunk_parts);
      const auto fp32_floats = static_cast<int64_t>(kernels::block_linear_state_floats(shape));
      if (states.numel() > fp32_floats) {  // the forward packed S behind the fp32 set
        a.packed_state = a.state + fp32_floats;
        a.packed_grad_state = a.grad_state + fp32_floats;
      }
      check_launch(kernels::linear_attention_backward(a, stream), "linear attention backward");
    }
    const auto [q_type, k_type] = input_dtypes(ctx);
    return {dq.to(q_type), dk.to(k_type), dv, dmixing, torch::Tensor(), torch::Tensor()};
  }
};

// What both dense-form functions (the dense tiles and the resident kernels) hold around a launch:
// the inputs in v's dtype and readable by the kernels, the mixing matrix in fp32 (empty: none),
// the output and the row sums den [B * H, N].
struct DenseFormTensors {
  torch::Tensor q, k, v, mixing, out, den;
  bool mixes() const { return mixing.numel() > 0; }

  static DenseFormTensors for_forward(const torch::Tensor& q_in, const torch::Tensor& k_in,
                                      const torch::Tensor& v_in, const torch::Tensor& mixing_in) {
    const auto dtype = v_in.scalar_type();
    DenseFormTensors t;
    t.q = readable(q_in, dtype), t.k = readable(k_in, dtype), t.v = readable(v_in, dtype);
    t.mixing =
        mixing_in.numel() > 0 ? mixing_in.detach().to(torch::kFloat32).contiguous() : mixing_in;
    t.out = torch::empty(t.q.sizes(), t.v.options().memory_format(torch::MemoryFormat::Contiguous));
    t.den = torch::empty({t.q.size(0) * t.q.size(2), t.q.size(1)},
                         t.q.options().dtype(torch::kFloat32));
    return t;
  }
  void save(torch::autograd::AutogradContext* ctx) const {
    ctx->save_for_backward({q, k, v, out, mixing, den});
  }
  static DenseFormTensors saved(torch::autograd::AutogradContext* ctx) {
    auto s = ctx->get_saved_variables();
    return {s[0], s[1], s[2], s[4], s[3], s[5]};
  }
};

// The gradients a dense-form backward writes: dq, dk, dv contiguous in v's dtype, dm in fp32
// when the op mixes.
struct DenseFormGradients {
  torch::Tensor dq, dk, dv, dmixing;
  DenseFormGradients(const DenseFormTensors& t, int64_t blocks) {
    auto contiguous = t.v.options().memory_format(torch::MemoryFormat::Contiguous);
    dq = torch::empty(t.q.sizes(), contiguous), dk = torch::empty(t.q.sizes(), contiguous);
    dv = torch::empty(t.q.sizes(), contiguous);
    if (t.mixes()) dmixing = torch::empty({blocks, blocks}, t.den.options());
  }
};

// The dense masked form (kernels/mhla/dense_block_linear.h) for the same ops: saves q, k, v, the
// output and the row sums; the backward's elementwise inputs g = do / (den + eps) and
// gd = -(do . o) / (den + eps) are formed here.
class DenseBlockLinearFunction : public torch::autograd::Function<DenseBlockLinearFunction> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& q_in,
                               const torch::Tensor& k_in, const torch::Tensor& v_in,
                               const torch::Tensor& mixing_in, int64_t blocks, bool causal) {
    const auto t = DenseFormTensors::for_forward(q_in, k_in, v_in, mixing_in);
    kernels::DenseBlockLinearForward a;
    a.shape = shape_of(t.q, blocks);
    a.dtype = kernel_dtype(t.v.scalar_type());
    a.q = view_of(t.q), a.k = view_of(t.k), a.v = view_of(t.v);
    a.mixing = t.mixes() ? t.mixing.data_ptr<float>() : nullptr;
    a.causal = causal;
    a.out = t.out.data_ptr();
    a.den = t.den.data_ptr<float>();
    const c10::cuda::CUDAGuard on_device(t.q.device());  // launch on the inputs' GPU
    auto stream = c10::cuda::getCurrentCUDAStream(t.q.device().index()).stream();
    check_launch(kernels::dense_block_linear_forward(a, stream), "dense block linear forward");
    t.save(ctx);
    ctx->saved_data["blocks"] = blocks;
    ctx->saved_data["causal"] = causal;
    remember_input_dtypes(ctx, q_in, k_in);
    return t.out;
  }

  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    const auto t = DenseFormTensors::saved(ctx);
    const int64_t blocks = ctx->saved_data["blocks"].toInt();
    const bool causal = ctx->saved_data["causal"].toBool();
    const auto b = t.q.size(0), n = t.q.size(1), h = t.q.size(2);
    // [B*H, N] -> [B, N, H, 1], with the kernels' epsilon.
    auto scale = (t.den.view({b, h, n}).permute({0, 2, 1}) + kNormalizerEps).unsqueeze(-1);
    auto grad_out = grads[0].to(torch::kFloat32);
    auto grad_scaled = (grad_out / scale).to(t.v.scalar_type()).contiguous();
    auto grad_den = (-(grad_out * t.out.to(torch::kFloat32)).sum(-1, true) / scale)
                        .squeeze(-1)
                        .permute({0, 2, 1})
                        .contiguous();  // [B, H, N]
    if (t.mixes()) require_ordered_sums("the dense-form MHLA backward (cuda_dense)");
    DenseFormGradients d(t, blocks);
    kernels::DenseBlockLinearBackward a;
    a.shape = shape_of(t.q, blocks);
    a.dtype = kernel_dtype(t.v.scalar_type());
    a.q = view_of(t.q), a.k = view_of(t.k), a.v = view_of(t.v);
    a.grad_scaled = view_of(grad_scaled);
    a.grad_den = grad_den.data_ptr<float>();
    a.causal = causal;
    if (t.mixes()) {
      a.mixing = t.mixing.data_ptr<float>();
      a.grad_mixing = d.dmixing.data_ptr<float>();
    }
    a.grad_q = d.dq.data_ptr(), a.grad_k = d.dk.data_ptr(), a.grad_v = d.dv.data_ptr();
    const c10::cuda::CUDAGuard on_device(t.q.device());  // launch on the inputs' GPU
    auto stream = c10::cuda::getCurrentCUDAStream(t.q.device().index()).stream();
    check_launch(kernels::dense_block_linear_backward(a, stream), "dense block linear backward");
    const auto [q_type, k_type] = input_dtypes(ctx);
    return {d.dq.to(q_type), d.dk.to(k_type), d.dv, d.dmixing, torch::Tensor(), torch::Tensor()};
  }
};

// Short sequences with the whole (batch, head) in shared memory
// (kernels/mhla/resident_block_linear.h): saves q, k, v, the output and the row sums; the
// backward kernel forms g and gd itself from do, o and the row sums.
class ResidentBlockLinearFunction : public torch::autograd::Function<ResidentBlockLinearFunction> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& q_in,
                               const torch::Tensor& k_in, const torch::Tensor& v_in,
                               const torch::Tensor& mixing_in, int64_t blocks,
                               int64_t backward_form = 0) {
    const auto t = DenseFormTensors::for_forward(q_in, k_in, v_in, mixing_in);
    kernels::ResidentBlockLinearForward a;
    a.shape = shape_of(t.q, blocks);
    a.dtype = kernel_dtype(t.v.scalar_type());
    a.q = view_of(t.q), a.k = view_of(t.k), a.v = view_of(t.v);
    a.mixing = t.mixes() ? t.mixing.data_ptr<float>() : nullptr;
    a.out = t.out.data_ptr();
    a.den = t.den.data_ptr<float>();
    const c10::cuda::CUDAGuard on_device(t.q.device());  // launch on the inputs' GPU
    auto stream = c10::cuda::getCurrentCUDAStream(t.q.device().index()).stream();
    check_launch(kernels::resident_block_linear_forward(a, stream),
                 "resident block linear forward");
    t.save(ctx);
    ctx->saved_data["blocks"] = blocks;
    ctx->saved_data["backward_form"] = backward_form;
    remember_input_dtypes(ctx, q_in, k_in);
    return t.out;
  }

  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    const auto t = DenseFormTensors::saved(ctx);
    const int64_t blocks = ctx->saved_data["blocks"].toInt();
    auto grad_out = readable(grads[0], t.v.scalar_type());
    DenseFormGradients d(t, blocks);
    kernels::ResidentBlockLinearBackward a;
    a.form = static_cast<kernels::ResidentBackwardForm>(ctx->saved_data["backward_form"].toInt());
    a.shape = shape_of(t.q, blocks);
    a.dtype = kernel_dtype(t.v.scalar_type());
    a.q = view_of(t.q), a.k = view_of(t.k), a.v = view_of(t.v);
    a.out = view_of(t.out), a.grad_out = view_of(grad_out);
    a.den = t.den.data_ptr<float>();
    // Deterministic: each (batch, head)'s part of dm, summed here in a fixed order.
    torch::Tensor dm_parts;
    if (t.mixes()) {
      a.mixing = t.mixing.data_ptr<float>();
      a.grad_mixing = d.dmixing.data_ptr<float>();
      if (deterministic_sums()) {
        dm_parts = torch::empty({t.q.size(0) * t.q.size(2), blocks, blocks}, t.den.options());
        a.grad_mixing_parts = dm_parts.data_ptr<float>();
      }
    }
    a.grad_q = d.dq.data_ptr(), a.grad_k = d.dk.data_ptr(), a.grad_v = d.dv.data_ptr();
    const c10::cuda::CUDAGuard on_device(t.q.device());  // launch on the inputs' GPU
    auto stream = c10::cuda::getCurrentCUDAStream(t.q.device().index()).stream();
    check_launch(kernels::resident_block_linear_backward(a, stream),
                 "resident block linear backward");
    if (dm_parts.defined())
      column_sums_into(dm_parts.view({dm_parts.size(0), -1}), d.dmixing.view({-1}));
    const auto [q_type, k_type] = input_dtypes(ctx);
    return {d.dq.to(q_type), d.dk.to(k_type), d.dv, d.dmixing, torch::Tensor(), torch::Tensor()};
  }
};

// One 16-CTA cluster per (batch, head) (kernels/mhla/cluster_block_linear.h): saves q, k, v and
// the mixing matrix only; the backward kernel recomputes the states and the output.
class ClusterBlockLinearFunction : public torch::autograd::Function<ClusterBlockLinearFunction> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& q_in,
                               const torch::Tensor& k_in, const torch::Tensor& v_in,
                               const torch::Tensor& mixing_in, int64_t blocks) {
    const auto t = DenseFormTensors::for_forward(q_in, k_in, v_in, mixing_in);
    kernels::ClusterBlockLinearForward a;
    a.shape = shape_of(t.q, blocks);
    a.dtype = kernel_dtype(t.v.scalar_type());
    a.q = view_of(t.q), a.k = view_of(t.k), a.v = view_of(t.v);
    a.mixing = t.mixes() ? t.mixing.data_ptr<float>() : nullptr;
    a.out = t.out.data_ptr();
    const c10::cuda::CUDAGuard on_device(t.q.device());  // launch on the inputs' GPU
    auto stream = c10::cuda::getCurrentCUDAStream(t.q.device().index()).stream();
    check_launch(kernels::cluster_block_linear_forward(a, stream), "cluster block linear forward");
    ctx->save_for_backward({t.q, t.k, t.v, t.mixing});
    ctx->saved_data["blocks"] = blocks;
    remember_input_dtypes(ctx, q_in, k_in);
    return t.out;
  }

  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    auto saved = ctx->get_saved_variables();
    auto q = saved[0], k = saved[1], v = saved[2], mixing = saved[3];
    const int64_t blocks = ctx->saved_data["blocks"].toInt();
    const bool mixes = mixing.numel() > 0;
    auto grad_out = readable(grads[0], v.scalar_type());
    auto contiguous = v.options().memory_format(torch::MemoryFormat::Contiguous);
    auto dq = torch::empty(q.sizes(), contiguous), dk = torch::empty(q.sizes(), contiguous);
    auto dv = torch::empty(q.sizes(), contiguous);
    if (mixes) require_ordered_sums("the cluster-family MHLA backward");
    torch::Tensor dmixing;
    if (mixes) dmixing = torch::empty({blocks, blocks}, q.options().dtype(torch::kFloat32));
    kernels::ClusterBlockLinearBackward a;
    a.shape = shape_of(q, blocks);
    a.dtype = kernel_dtype(v.scalar_type());
    a.q = view_of(q), a.k = view_of(k), a.v = view_of(v), a.grad_out = view_of(grad_out);
    if (mixes) {
      a.mixing = mixing.data_ptr<float>();
      a.grad_mixing = dmixing.data_ptr<float>();
    }
    a.grad_q = dq.data_ptr(), a.grad_k = dk.data_ptr(), a.grad_v = dv.data_ptr();
    const c10::cuda::CUDAGuard on_device(q.device());  // launch on the inputs' GPU
    auto stream = c10::cuda::getCurrentCUDAStream(q.device().index()).stream();
    check_launch(kernels::cluster_block_linear_backward(a, stream),
                 "cluster block linear backward");
    const auto [q_type, k_type] = input_dtypes(ctx);
    return {dq.to(q_type), dk.to(k_type), dv, dmixing, torch::Tensor()};
  }
};

// Which bidirectional kernel family the `cuda` backend takes: by default the resident kernels
// where they fit, else the state kernels. The cluster kernels are correct but slower than the
// state kernels on the H200 (1.35 against 0.82 ms for MHLA at B = 64, N = 1,024, H = 6, D = 64;
// experiments/attention_vision.md, session 16), so they run only when asked for:
// MHLA_BIDIRECTIONAL_KERNEL = cluster / states puts that family first (for A/B runs in one
// binary; a family that does not take the shape falls through to the state kernels).
enum class Family { resident, cluster, states };

std::vector<Family> family_order() {
  static const std::vector<Family> order = [] {
    const char* value = std::getenv("MHLA_BIDIRECTIONAL_KERNEL");
    const std::string choice = value != nullptr ? value : "";
    if (choice == "cluster") return std::vector{Family::cluster, Family::resident, Family::states};
    if (choice == "states") return std::vector{Family::states};
    return std::vector{Family::resident, Family::states};
  }();
  return order;
}

bool cluster_takes(const torch::Tensor& q, const torch::Tensor& v, int64_t blocks) {
  const auto type = v.scalar_type();
  if (type != torch::kFloat16 && type != torch::kBFloat16) return false;
  return kernels::cluster_block_linear_supported(shape_of(q, blocks), kernel_dtype(type));
}

// Whether the resident kernels take these inputs (dtype of v, as the functions compute in it).
bool resident_takes(const torch::Tensor& q, const torch::Tensor& v, int64_t blocks) {
  const auto type = v.scalar_type();
  if (type != torch::kFloat16 && type != torch::kBFloat16) return false;
  return kernels::resident_block_linear_supported(shape_of(q, blocks), kernel_dtype(type));
}

// Linear attention (one block, no mixing) on the state kernels' fragment passes beats the
// resident kernels even where those fit: 0.260 against 0.528 ms at B = 256, N = 256, H = 6,
// D = 64 on the H200 (experiments/attention_vision.md, session 24). MHLA's short blocks keep the
// resident kernels (its state kernels took 1.817 ms there: one state per 16 tokens).
bool states_beat_resident(const torch::Tensor& q, const torch::Tensor& v,
                          const torch::Tensor& mixing) {
  const auto type = v.scalar_type();
  return mixing.numel() == 0 && (type == torch::kFloat16 || type == torch::kBFloat16) &&
         kernels::fragment_passes_in_use(kernel_dtype(type), static_cast<int>(q.size(3)));
}

// The resident kernels for short MHLA sequences, the state kernels otherwise (`cuda` backend;
// family_order says how to put the cluster kernels first).
torch::Tensor block_linear_by_family(const torch::Tensor& q, const torch::Tensor& k,
                                     const torch::Tensor& v, const torch::Tensor& mixing,
                                     int64_t blocks) {
  for (const Family family : family_order()) {
    if (family == Family::resident && resident_takes(q, v, blocks) &&
        !states_beat_resident(q, v, mixing)) {
      return ResidentBlockLinearFunction::apply(q, k, v, mixing, blocks);
    }
    if (family == Family::cluster && cluster_takes(q, v, blocks)) {
      return ClusterBlockLinearFunction::apply(q, k, v, mixing, blocks);
    }
  }
  return BlockLinearFunction::apply(q, k, v, mixing, blocks);
}

// The dense kernels where they take the shape and dtype (the resident ones first), the state
// kernels otherwise.
torch::Tensor block_linear_dense_or_states(const torch::Tensor& q, const torch::Tensor& k,
                                           const torch::Tensor& v, const torch::Tensor& mixing,
                                           int64_t blocks) {
  const auto dtype = v.scalar_type();
  if (resident_takes(q, v, blocks)) {
    return ResidentBlockLinearFunction::apply(q, k, v, mixing, blocks);
  }
  if (kernels::dense_block_linear_supported(shape_of(q, blocks), kernel_dtype(dtype), false)) {
    return DenseBlockLinearFunction::apply(q, k, v, mixing, blocks, false);
  }
  return BlockLinearFunction::apply(q, k, v, mixing, blocks);
}

// Causal: 64-token blocks, the expanded causal mixing matrix (its gradient flows back to the
// learned one through causal_mixing_matrix); sequences beyond 64 blocks (or tiles that do not
// fit) run the plain-LibTorch reference.
torch::Tensor causal_dense_or_reference(const torch::Tensor& q, const torch::Tensor& k,
                                        const torch::Tensor& v, const torch::Tensor& mixing) {
  const int64_t blocks = (q.size(1) + kernels::kDenseCausalBlock - 1) / kernels::kDenseCausalBlock;
  const auto type = v.scalar_type();
  const auto d = q.size(3);
  const bool kernel_inputs =
      (type == torch::kFloat32 || type == torch::kFloat16 || type == torch::kBFloat16) &&
      (d == 32 || d == 64 || d == 128) && q.size(0) * q.size(2) <= 65535;
  if (!kernel_inputs ||
      !kernels::dense_block_linear_supported(shape_of(q, blocks), kernel_dtype(type), true)) {
    return mixing.defined() ? causal_mhla_reference(q, k, v, mixing)
                            : causal_linear_attention_reference(q, k, v);
  }
  auto expanded = mixing.defined()
                      ? causal_mixing_matrix(mixing.to(torch::kFloat32), blocks).contiguous()
                      : torch::empty({0}, q.options().dtype(torch::kFloat32));
  return DenseBlockLinearFunction::apply(q, k, v, expanded, blocks, true);
}

}  // namespace

// The resident family's backward forms by name (tests and A/B runs): "resident" leaves the
// choice to the kernels; "resident-warpgroup", "resident-state" and "resident-scores" ask for
// one, and a name takes only shapes that form computes.
std::optional<kernels::ResidentBackwardForm> resident_form_named(const std::string& family) {
  using F = kernels::ResidentBackwardForm;
  if (family == "resident") return F::automatic;
  if (family == "resident-warpgroup") return F::warpgroup;
  if (family == "resident-state") return F::state;
  if (family == "resident-scores") return F::scores;
  return std::nullopt;
}

bool block_linear_family_takes(const std::string& family, const torch::Tensor& q,
                               const torch::Tensor& v, int64_t blocks) {
  using F = kernels::ResidentBackwardForm;
  if (const auto form = resident_form_named(family)) {
    if (!resident_takes(q, v, blocks)) return false;
    const auto shape = shape_of(q, blocks);
    const auto dtype = kernel_dtype(v.scalar_type());
    if (*form == F::warpgroup) return kernels::resident_warpgroup_backward_supported(shape, dtype);
    if (*form == F::state)
      return blocks > 1 && kernels::resident_state_backward_supported(shape, dtype);
    return true;
  }
  if (family == "cluster") return cluster_takes(q, v, blocks);
  if (family == "states" || family == "states-passes") return true;
  if (family == "states-sequence") {  // MHLA only: linear attention has no forward to fuse
    const auto type = v.scalar_type();
    return blocks > 1 && (type == torch::kFloat16 || type == torch::kBFloat16) &&
           sequence_forward_fits(shape_of(q, blocks), kernel_dtype(type));
  }
  fail(
      "unknown bidirectional kernel family '{}' (resident, resident-warpgroup, resident-state, "
      "resident-scores, cluster, states, states-passes, states-sequence)",
      family);
}

torch::Tensor block_linear_by_named_family(const std::string& family, const torch::Tensor& q,
                                           const torch::Tensor& k, const torch::Tensor& v,
                                           const torch::Tensor& mixing, int64_t blocks) {
  check_inputs(mixing.numel() > 0 ? "mhla" : "linear", q, k, v, blocks);
  if (!block_linear_family_takes(family, q, v, blocks)) {
    fail("the {} kernels do not take q {} ({}) with {} blocks", family, c10::str(q.sizes()),
         c10::toString(v.scalar_type()), blocks);
  }
  if (const auto form = resident_form_named(family)) {
    return ResidentBlockLinearFunction::apply(q, k, v, mixing, blocks, static_cast<int64_t>(*form));
  }
  if (family == "cluster") return ClusterBlockLinearFunction::apply(q, k, v, mixing, blocks);
  const auto form = family == "states-passes"     ? StatesForward::passes
                    : family == "states-sequence" ? StatesForward::sequence
                                                  : StatesForward::automatic;
  return BlockLinearFunction::apply(q, k, v, mixing, blocks, static_cast<int64_t>(form));
}

torch::Tensor linear_attention_cuda(const torch::Tensor& q, const torch::Tensor& k,
                                    const torch::Tensor& v, const OpArgs& args) {
  if (args.causal) return causal_block_linear_cuda(q, k, v, torch::Tensor());
  check_inputs("linear", q, k, v, 1);
  // Autograd functions take defined tensors only: an empty one means "no mixing".
  return block_linear_by_family(q, k, v, torch::empty({0}, q.options().dtype(torch::kFloat32)), 1);
}

torch::Tensor mhla_cuda(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                        const OpArgs& args) {
  if (args.causal) return causal_block_linear_cuda(q, k, v, args.mixing);
  check_inputs("mhla", q, k, v, args.blocks);
  if (!args.mixing.defined() || args.mixing.dim() != 2 || args.mixing.size(0) != args.blocks ||
      args.mixing.size(1) != args.blocks) {
    fail("mhla (cuda): mixing must be [blocks, blocks] = [{}, {}]", args.blocks, args.blocks);
  }
  check_same_device("mhla (cuda)", q, {{"the mixing matrix", args.mixing}});
  return block_linear_by_family(q, k, v, args.mixing, args.blocks);
}

torch::Tensor linear_attention_cuda_dense(const torch::Tensor& q, const torch::Tensor& k,
                                          const torch::Tensor& v, const OpArgs& args) {
  if (args.causal) {
    check_causal_inputs("linear", q, k, v);
    return causal_dense_or_reference(q, k, v, torch::Tensor());
  }
  check_inputs("linear", q, k, v, 1);
  return block_linear_dense_or_states(q, k, v,
                                      torch::empty({0}, q.options().dtype(torch::kFloat32)), 1);
}

torch::Tensor mhla_cuda_dense(const torch::Tensor& q, const torch::Tensor& k,
                              const torch::Tensor& v, const OpArgs& args) {
  if (args.causal) {
    check_causal_inputs("mhla", q, k, v);
    if (!args.mixing.defined() || args.mixing.dim() != 2 ||
        args.mixing.size(0) != args.mixing.size(1)) {
      fail("mhla (cuda_dense): the causal mixing matrix must be square");
    }
    check_same_device("mhla (cuda_dense, causal)", q, {{"the mixing matrix", args.mixing}});
    return causal_dense_or_reference(q, k, v, args.mixing);
  }
  check_inputs("mhla", q, k, v, args.blocks);
  if (!args.mixing.defined() || args.mixing.dim() != 2 || args.mixing.size(0) != args.blocks ||
      args.mixing.size(1) != args.blocks) {
    fail("mhla (cuda_dense): mixing must be [blocks, blocks] = [{}, {}]", args.blocks, args.blocks);
  }
  check_same_device("mhla (cuda_dense)", q, {{"the mixing matrix", args.mixing}});
  return block_linear_dense_or_states(q, k, v, args.mixing, args.blocks);
}

}  // namespace mhla

#endif  // MHLA_WITH_CUDA_KERNELS
