#pragma once
// Fused chunked gated DeltaNet (one decay per head and token) and KDA (one per key dimension),
// forward and backward, chunk 64,
// bf16 or fp16 q, k, v with fp32 states, gate sums and gradients of beta and g. Per chunk of 64
// tokens with G the running sum of g inside the chunk, A_rs = beta_r (k_r . k_s) exp(G_r - G_s)
// (s < r) and T = (I + A)^-1:
//   W  = T diag(beta exp(G)) K,   U0 = T diag(beta) V                  (prepare, per chunk)
//   u  = U0 - W S_i,  S_{i+1} = exp(G_C) S_i + (exp(G_C - G) . K)^T u  (states, sequential)
//   o  = scale [(exp(G) . Q) S_i + (Q K^T . D) u],  D_rs = exp(G_r - G_s) for s <= r  (output)
// The backward runs the same passes in reverse: the state gradients carried from the last chunk
// to the first (sequential; du, with its part from the chunk's own outputs, P^T dO', formed on
// the way from the P the forward kept), then per chunk dq, the
// output and state parts of dk and the gate, dW, and the WY system's backward (dk, dv, dbeta,
// dg; dg is the reverse running sum of dG inside the chunk): one pass for gated DeltaNet, two
// for KDA. Inputs are token-major
// [B, T, H, D] (D contiguous); the per-chunk intermediates are [B*H, chunks, 64, D] (states
// [B*H, chunks, Dk, Dv]). T need not be a multiple of 64: the last chunk is padded with
// q = k = v = 0, beta = 0, g = 0, which neither write nor decay the state.
//
// KDA (per_key_gate) has G [64, D] and the same passes with every decay taken per key dimension
// d: A_rs = beta_r sum_d k_rd k_sd exp(G_rd - G_sd), W = T diag(beta) (exp(G) . K), o = scale
// [(exp(G) . Q) S_i + P u] with P_rs = sum_d q_rd k_sd exp(G_rd - G_sd) (s <= r), and S_{i+1} =
// Diag(exp(G_C)) S_i + (exp(G_C - G) . K)^T u. The pairwise decays inside a chunk are formed by
// 16-token sub-chunks so that no factor exceeds 1 (kernels/gated_delta/per_key_scores.cuh); the
// prepare pass keeps exp(G) . Q, exp(G_C - G) . K, P and the unscaled key scores for the others.
#include <cstdint>

#include <cuda_runtime.h>

#include "mhla/block_linear_attention.h"  // DType

namespace mhla_kernels {

constexpr int kGatedDeltaChunk = 64;

// Key and value head dims the fused kernels take (Dk == Dv); others use the batched path.
inline bool gated_delta_fused_supports(int key_dim, int value_dim) {
  return key_dim == value_dim && (key_dim == 64 || key_dim == 128);
}

struct GatedDeltaArgs {
  DType dtype = DType::bf16;  // of q, k, v, d_out and the element-type buffers below (not f32)
  int batch = 0, tokens = 0, heads = 0, head_dim = 0;
  float scale = 1.f;
  // KDA: gate, dgate [B, T, H, D]; gate_sums, dgate_partial [BH, chunks * 64, D].
  bool per_key_gate = false;
  // Inputs, token-major.
  const void *q = nullptr, *k = nullptr, *v = nullptr;  // [B, T, H, D]
  const float* beta = nullptr;                          // [B, T, H]
  const float* gate = nullptr;                          // [B, T, H], log-space, <= 0
  const float* initial_state = nullptr;                 // [B, H, D, D] or null (zeros)
  // Forward results and the intermediates the backward reads.
  float* gate_sums = nullptr;    // [BH, chunks * 64]: G
  void* w = nullptr;             // [BH, chunks, 64, D]
  void* u0 = nullptr;            // [BH, chunks, 64, D]
  void* t_inverse = nullptr;     // [BH, chunks, 64, 64]: (I + A)^-1
  void* u = nullptr;             // [BH, chunks, 64, D]
  void* states = nullptr;        // [BH, chunks, D, D]: the state entering each chunk
  void* scores = nullptr;        // [BH, chunks, 64, 64]: P (lower, with the diagonal)
  void* out = nullptr;           // [B, T, H, D]
  float* final_state = nullptr;  // [B, H, D, D]
  // KDA only, per chunk (see above).
  void* q_gated = nullptr;     // [BH, chunks, 64, D]: exp(G) . Q
  void* k_to_end = nullptr;    // [BH, chunks, 64, D]: exp(G_C - G) . K
  void* key_scores = nullptr;  // [BH, chunks, 64, 64]: A / beta_r (strictly lower)
  // Backward.
  const void* d_out = nullptr;              // [B, T, H, D]
  const float* final_state_grad = nullptr;  // [B, H, D, D] or null (zeros)
  void* du = nullptr;                       // [BH, chunks, 64, D] scratch
  void* state_grads = nullptr;              // [BH, chunks, D, D] scratch: dS leaving each chunk
  // KDA only (gated DeltaNet keeps them on chip): from the chunk-gradient pass to the WY pass.
  void* dw = nullptr;              // [BH, chunks, 64, D] scratch (a product operand)
  float* dk_partial = nullptr;     // [BH, chunks, 64, D] scratch
  float* dgate_partial = nullptr;  // [BH, chunks * 64, D] scratch
  void *dq = nullptr, *dk = nullptr, *dv = nullptr;  // [B, T, H, D]
  float* dbeta = nullptr;                            // [B, T, H]
  float* dgate = nullptr;                            // [B, T, H]
  float* initial_state_grad = nullptr;               // [B, H, D, D] or null (not wanted)
  // Pipelining (see gated_delta_walk_segments): fp32 [2, B*H, D, D] scratch for the state carried
  // between walk segments, or null (the walks run whole).
  float* walk_scratch = nullptr;
  // The chunks a pass covers, [chunk_begin, chunk_end) (chunk_end 0: to the last). The entry
  // points set them for the segments of a pipelined walk; callers leave them alone.
  int chunk_begin = 0, chunk_end = 0;
};

#ifdef __CUDACC__
#define MHLA_GATED_DELTA_HD __host__ __device__
#else
#define MHLA_GATED_DELTA_HD
#endif

MHLA_GATED_DELTA_HD inline int gated_delta_chunks(int tokens) {
  return (tokens + kGatedDeltaChunk - 1) / kGatedDeltaChunk;
}

// How many segments the entry points cut the state walks into: more than one where the walks'
// grid leaves at least half the SMs idle (long sequences, few batch x heads). Each segment's
// per-chunk passes (output; the chunk gradients) then run beside the next segment's walk, on the
// idle SMs, and the walk on a stream of higher priority. The
// results are the same bit for bit: the state crosses a segment boundary in fp32 through
// walk_scratch, which must be set when this is > 1 (else the walks run whole).
// MHLA_DELTA_WALK_SEGMENTS=N forces N (1: no pipelining).
int gated_delta_walk_segments(const GatedDeltaArgs& args);

// Fills gate_sums, w, u0, u, states, scores, out and final_state (and for KDA q_gated, k_to_end,
// key_scores).
cudaError_t gated_delta_forward(const GatedDeltaArgs& args, cudaStream_t stream);
// Reads the inputs and the forward's intermediates; fills the scratch buffers and dq, dk, dv,
// dbeta, dgate and (when asked) initial_state_grad.
cudaError_t gated_delta_backward(const GatedDeltaArgs& args, cudaStream_t stream);

}  // namespace mhla_kernels
