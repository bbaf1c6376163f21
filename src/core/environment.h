#pragma once
// On/off switches read from the environment, for A/B comparisons of kernels in one binary
// (MHLA_FUSED_NORM=0, MHLA_LINEAR_BIAS_KERNEL=0): "0" is off, "1" is on, anything else or unset
// is the default. Callers keep the answer in a static (read once per process).
#include <cstdlib>
#include <cstring>
#include <string>

namespace mhla {

inline bool environment_switch(const char* name, bool default_on) {
  const char* value = std::getenv(name);
  if (value == nullptr) return default_on;
  if (std::strcmp(value, "0") == 0) return false;
  if (std::strcmp(value, "1") == 0) return true;
  return default_on;
}

// "NAME=value, ..." for the switches that are set, "" when none is: runs log it, so a run folder
// says when a kernel was swapped out.
inline std::string environment_switches_set() {
  std::string out;
  // clang-format off
  for (const char* name :
       {"MHLA_FUSED_NORM", "MHLA_FUSED_RESIDUAL_NORM", "MHLA_LINEAR_BIAS_KERNEL", "MHLA_FUSED_CE",
        "MHLA_FUSED_QKV_ROTARY", "MHLA_FUSED_GATED_NORM", "MHLA_DECODE_VEC", "MHLA_CAUSAL_MIX_GEMM",
        "MHLA_BIDIRECTIONAL_KERNEL", "MHLA_DELTA_GRADS_PERSISTENT", "MHLA_FUSED_SHORT_CONV",
        "MHLA_SHORT_CONV_GROUP", "MHLA_FUSED_ADALN", "MHLA_FUSED_MIX_BACKWARD",
        "MHLA_CAUSAL_LEAN_PASSES", "MHLA_CAUSAL_PACKED_PREFIX", "MHLA_CAUSAL_PACKED_STATES",
        "MHLA_PAIR_PRODUCTS_SHARED", "MHLA_SWEEP_AHEAD", "MHLA_FRAGMENT_PASSES",
        "MHLA_PACKED_STATE_SETS", "MHLA_STATE_MIX", "MHLA_RESIDENT_STATE_BACKWARD",
        "MHLA_RESIDENT_BACKWARD", "MHLA_RESIDENT_FORWARD",
        "MHLA_FRAGMENT_ONE_TILE", "MHLA_SCALAR_STATE_ADDS", "MHLA_PACKED_BLOCK_STATES",
        "MHLA_MIX_BACKWARD_STORES", "MHLA_PIPELINED_PASSES",
        "MHLA_PACKED_STATE_STORES", "MHLA_PACKED_STATE_MIX", "MHLA_DEPENDENT_LAUNCH",
        "MHLA_QUERY_PASS_CTAS", "MHLA_MIX_GRID", "MHLA_FUSED_MLP", "MHLA_FUSED_MLP_BACKWARD"}) {
    // clang-format on
    if (const char* value = std::getenv(name)) {
      if (!out.empty()) out += ", ";
      out += std::string(name) + "=" + value;
    }
  }
  return out;
}

}  // namespace mhla
