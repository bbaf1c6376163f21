#pragma once
// One-token decoding step of the gated delta rule (gated DeltaNet and KDA) on the GPU, the fp32
// state updated in place:
//   S~  = Diag(a) S,  a = exp(g) (one value per head, or one per key dimension for KDA)
//   u   = beta (v - S~^T k)
//   S  <- S~ + k u^T
//   o   = scale S^T q
// Each thread keeps a few rows of a few adjacent state columns in registers: the state is read
// once and written once (16-byte accesses where aligned), which is all the step needs to move.
#include <cstdint>

#include <cuda_runtime.h>

#include "mhla/block_linear_attention.h"  // DType

namespace mhla_kernels {

struct DeltaDecodeArgs {
  DType dtype = DType::bf16;                             // of q, k, v and out
  int batch = 0, heads = 0, key_dim = 0, value_dim = 0;  // key_dim <= 256
  const void* q = nullptr;                               // [B, H, Dk] contiguous
  const void* k = nullptr;                               // [B, H, Dk]
  const void* v = nullptr;                               // [B, H, Dv]
  const float* beta = nullptr;                           // [B, H]
  const float* g = nullptr;                              // [B, H], or [B, H, Dk] when per_key_gate
  bool per_key_gate = false;
  float* state = nullptr;  // [B, H, Dk, Dv] contiguous fp32, updated in place
  void* out = nullptr;     // [B, H, Dv]
  float scale = 1.0f;
};

cudaError_t delta_rule_decode(const DeltaDecodeArgs& args, cudaStream_t stream);

}  // namespace mhla_kernels
