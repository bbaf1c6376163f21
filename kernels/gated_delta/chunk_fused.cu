// Entry points of the fused gated DeltaNet: argument checks, then the passes in order on one
// stream (kernels/gated_delta/chunk_passes.h).
#include "gated_delta/chunk_fused.h"

#include "gated_delta/chunk_passes.h"

namespace mhla_kernels {
namespace {

bool common_ok(const GatedDeltaArgs& a) {
  return a.batch > 0 && a.tokens > 0 && a.heads > 0 &&
         gated_delta_fused_supports(a.head_dim, a.head_dim) && a.dtype != DType::f32 && a.q &&
         a.k && a.v && a.beta && a.gate && a.gate_sums && a.w && a.u0 && a.t_inverse && a.u &&
         a.states && static_cast<int64_t>(a.batch) * a.heads <= 65535;
}

}  // namespace

cudaError_t gated_delta_forward(const GatedDeltaArgs& a, cudaStream_t stream) {
  if (!common_ok(a) || !a.out || !a.final_state) return cudaErrorInvalidValue;
  for (auto pass :
       {gated_delta::run_prepare, gated_delta::run_states_forward, gated_delta::run_output}) {
    if (cudaError_t err = pass(a, stream); err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

cudaError_t gated_delta_backward(const GatedDeltaArgs& a, cudaStream_t stream) {
  if (!common_ok(a) || !a.d_out || !a.du_local || !a.du || !a.state_grads || !a.dw ||
      !a.dk_partial || !a.dgate_partial || !a.dq || !a.dk || !a.dv || !a.dbeta || !a.dgate) {
    return cudaErrorInvalidValue;
  }
  for (auto pass : {gated_delta::run_local_value_grads, gated_delta::run_states_backward,
                    gated_delta::run_chunk_grads, gated_delta::run_wy_backward}) {
    if (cudaError_t err = pass(a, stream); err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

}  // namespace mhla_kernels
