// Entry points of the fused gated DeltaNet and KDA: argument checks, then the passes in order on
// one stream (kernels/gated_delta/chunk_passes.h).
#include "gated_delta/chunk_fused.h"

#include "gated_delta/chunk_passes.h"

#include <initializer_list>

namespace mhla_kernels {
namespace {

bool common_ok(const GatedDeltaArgs& a) {
  return a.batch > 0 && a.tokens > 0 && a.heads > 0 &&
         gated_delta_fused_supports(a.head_dim, a.head_dim) && a.dtype != DType::f32 && a.q &&
         a.k && a.v && a.beta && a.gate && a.gate_sums && a.w && a.u0 && a.t_inverse && a.u &&
         a.states && a.scores && static_cast<int64_t>(a.batch) * a.heads <= 65535 &&
         (!a.per_key_gate || (a.q_gated && a.k_to_end && a.key_scores));
}

using Pass = cudaError_t (*)(const GatedDeltaArgs&, cudaStream_t);

cudaError_t run_passes(std::initializer_list<Pass> passes, const GatedDeltaArgs& a,
                       cudaStream_t stream) {
  for (Pass pass : passes) {
    if (cudaError_t err = pass(a, stream); err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

}  // namespace

cudaError_t gated_delta_forward(const GatedDeltaArgs& a, cudaStream_t stream) {
  using namespace gated_delta;
  if (!common_ok(a) || !a.out || !a.final_state) return cudaErrorInvalidValue;
  return run_passes(
      {a.per_key_gate ? run_kda_prepare : run_prepare, run_states_forward, run_output}, a, stream);
}

cudaError_t gated_delta_backward(const GatedDeltaArgs& a, cudaStream_t stream) {
  if (!common_ok(a) || !a.d_out || !a.du || !a.state_grads || !a.dq || !a.dk || !a.dv || !a.dbeta ||
      !a.dgate) {
    return cudaErrorInvalidValue;
  }
  using namespace gated_delta;
  if (a.per_key_gate) {
    if (!a.dw || !a.dk_partial || !a.dgate_partial) return cudaErrorInvalidValue;
    return run_passes({run_states_backward, run_kda_chunk_grads, run_kda_wy_backward}, a, stream);
  }
  return run_passes({run_states_backward, run_chunk_grads}, a, stream);
}

}  // namespace mhla_kernels
