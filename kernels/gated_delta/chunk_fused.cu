// Entry points of the fused gated DeltaNet and KDA: argument checks, then the passes in order
// (kernels/gated_delta/chunk_passes.h): on the caller's stream, or with the state walks cut into
// segments and pipelined against the per-chunk passes (gated_delta_walk_segments).
#include "gated_delta/chunk_fused.h"

#include "gated_delta/chunk_passes.h"

#include <initializer_list>
#include <map>
#include <vector>

namespace mhla_kernels {
namespace {

bool common_ok(const GatedDeltaArgs& a) {
  return a.batch > 0 && a.tokens > 0 && a.heads > 0 &&
         gated_delta_fused_supports(a.head_dim, a.head_dim) && a.dtype != DType::f32 && a.q &&
         a.k && a.v && a.beta && a.gate && a.gate_sums && a.w && a.u0 && a.t_inverse && a.u &&
         a.states && a.scores && static_cast<int64_t>(a.batch) * a.heads <= 65535 &&
         a.chunk_begin == 0 && a.chunk_end == 0 &&
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

// The pipelined walks' own stream, at the device's highest priority so that its CTAs take the
// SMs first whenever the per-chunk passes queue beside it, and the events that order the two
// streams: per calling thread and device, made once.
struct WalkStream {
  cudaStream_t stream = nullptr;
  std::vector<cudaEvent_t> events;  // [0, n): a pass on the caller's stream; [n, 2n): a walk
};

cudaError_t walk_stream(int segments, WalkStream** out) {
  thread_local std::map<int, WalkStream> per_device;
  int device = 0;
  if (cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) return err;
  WalkStream& w = per_device[device];
  if (w.stream == nullptr) {
    int least = 0, greatest = 0;
    if (cudaError_t err = cudaDeviceGetStreamPriorityRange(&least, &greatest); err != cudaSuccess)
      return err;
    if (cudaError_t err = cudaStreamCreateWithPriority(&w.stream, cudaStreamNonBlocking, greatest);
        err != cudaSuccess) {
      w.stream = nullptr;
      return err;
    }
  }
  while (static_cast<int>(w.events.size()) < 2 * segments) {
    cudaEvent_t e;
    if (cudaError_t err = cudaEventCreateWithFlags(&e, cudaEventDisableTiming); err != cudaSuccess)
      return err;
    w.events.push_back(e);
  }
  *out = &w;
  return cudaSuccess;
}

// Segment k of n: its chunks, and where its walk's state comes from and goes to. The state
// between segments k and k + 1 is carried in half (k % 2) of the scratch.
struct Segments {
  const GatedDeltaArgs& a;
  int n;
  // The chunks before segment k: equal shares, at least one chunk each (n <= chunks). Shorter
  // end segments (less of the walk alone at the start, less of the per-chunk passes alone at
  // the end) measured no faster: at T = 32,768 gated DeltaNet took 2.66-2.68 ms with the end
  // segments a quarter of the others and 2.66 with equal ones.
  int begin(int k) const {
    return static_cast<int>(static_cast<int64_t>(gated_delta_chunks(a.tokens)) * k / n);
  }
  float* carry(int k) const {
    return a.walk_scratch +
           static_cast<int64_t>(k % 2) * a.batch * a.heads * a.head_dim * a.head_dim;
  }
  GatedDeltaArgs chunks(int k) const {
    GatedDeltaArgs s = a;
    s.chunk_begin = begin(k);
    s.chunk_end = begin(k + 1);
    return s;
  }
  GatedDeltaArgs forward_walk(int k) const {
    GatedDeltaArgs s = chunks(k);
    if (k > 0) s.initial_state = carry(k - 1);
    if (k + 1 < n) s.final_state = carry(k);
    return s;
  }
  GatedDeltaArgs backward_walk(int k) const {  // walked from k = n - 1 down
    GatedDeltaArgs s = chunks(k);
    if (k + 1 < n) s.final_state_grad = carry(k + 1);
    if (k > 0) s.initial_state_grad = carry(k);
    return s;
  }
};

// Forward: the prepare passes of every segment, then the walks one after another on the walk
// stream (each once its segment is prepared) and each segment's outputs once its walk is done.
cudaError_t forward_pipelined(const GatedDeltaArgs& a, int n, Pass prepare, cudaStream_t main) {
  WalkStream* w = nullptr;
  if (cudaError_t err = walk_stream(n, &w); err != cudaSuccess) return err;
  const Segments seg{a, n};
  for (int k = 0; k < n; ++k) {
    if (cudaError_t err = prepare(seg.chunks(k), main); err != cudaSuccess) return err;
    if (cudaError_t err = cudaEventRecord(w->events[k], main); err != cudaSuccess) return err;
  }
  for (int k = 0; k < n; ++k) {
    if (cudaError_t err = cudaStreamWaitEvent(w->stream, w->events[k]); err != cudaSuccess)
      return err;
    if (cudaError_t err = gated_delta::run_states_forward(seg.forward_walk(k), w->stream);
        err != cudaSuccess) {
      return err;
    }
    if (cudaError_t err = cudaEventRecord(w->events[n + k], w->stream); err != cudaSuccess)
      return err;
  }
  // The caller's stream waits for every walk before its segment's outputs: it has joined the
  // walk stream when this returns.
  for (int k = 0; k < n; ++k) {
    if (cudaError_t err = cudaStreamWaitEvent(main, w->events[n + k]); err != cudaSuccess)
      return err;
    if (cudaError_t err = gated_delta::run_output(seg.chunks(k), main); err != cudaSuccess)
      return err;
  }
  return cudaSuccess;
}

// Backward: the walks from the last segment to the first on the walk stream, each segment's
// per-chunk gradients once its walk is done.
cudaError_t backward_pipelined(const GatedDeltaArgs& a, int n,
                               std::initializer_list<Pass> chunk_passes, cudaStream_t main) {
  WalkStream* w = nullptr;
  if (cudaError_t err = walk_stream(n, &w); err != cudaSuccess) return err;
  const Segments seg{a, n};
  if (cudaError_t err = cudaEventRecord(w->events[0], main); err != cudaSuccess) return err;
  if (cudaError_t err = cudaStreamWaitEvent(w->stream, w->events[0]); err != cudaSuccess)
    return err;
  for (int k = n - 1; k >= 0; --k) {
    if (cudaError_t err = gated_delta::run_states_backward(seg.backward_walk(k), w->stream);
        err != cudaSuccess) {
      return err;
    }
    if (cudaError_t err = cudaEventRecord(w->events[n + k], w->stream); err != cudaSuccess)
      return err;
  }
  for (int k = n - 1; k >= 0; --k) {
    if (cudaError_t err = cudaStreamWaitEvent(main, w->events[n + k]); err != cudaSuccess)
      return err;
    if (cudaError_t err = run_passes(chunk_passes, seg.chunks(k), main); err != cudaSuccess)
      return err;
  }
  return cudaSuccess;
}

// Segments to use: the walks' choice when the scratch to carry the state is there, else one.
int segments_of(const GatedDeltaArgs& a) {
  return a.walk_scratch != nullptr ? gated_delta::walk_segments(a) : 1;
}

}  // namespace

int gated_delta_walk_segments(const GatedDeltaArgs& a) {
  if (a.batch <= 0 || a.tokens <= 0 || a.heads <= 0 ||
      !gated_delta_fused_supports(a.head_dim, a.head_dim)) {
    return 1;
  }
  return gated_delta::walk_segments(a);
}

cudaError_t gated_delta_forward(const GatedDeltaArgs& a, cudaStream_t stream) {
  using namespace gated_delta;
  if (!common_ok(a) || !a.out || !a.final_state) return cudaErrorInvalidValue;
  const Pass prepare = a.per_key_gate ? run_kda_prepare : run_prepare;
  if (const int n = segments_of(a); n > 1) return forward_pipelined(a, n, prepare, stream);
  return run_passes({prepare, run_states_forward, run_output}, a, stream);
}

cudaError_t gated_delta_backward(const GatedDeltaArgs& a, cudaStream_t stream) {
  if (!common_ok(a) || !a.d_out || !a.du || !a.state_grads || !a.dq || !a.dk || !a.dv || !a.dbeta ||
      !a.dgate) {
    return cudaErrorInvalidValue;
  }
  using namespace gated_delta;
  if (a.per_key_gate && (!a.dw || !a.dk_partial || !a.dgate_partial)) return cudaErrorInvalidValue;
  const int n = segments_of(a);
  if (a.per_key_gate) {
    if (n > 1) return backward_pipelined(a, n, {run_kda_chunk_grads, run_kda_wy_backward}, stream);
    return run_passes({run_states_backward, run_kda_chunk_grads, run_kda_wy_backward}, a, stream);
  }
  if (n > 1) return backward_pipelined(a, n, {run_chunk_grads}, stream);
  return run_passes({run_states_backward, run_chunk_grads}, a, stream);
}

}  // namespace mhla_kernels
