#include "core/environment.h"

#include <algorithm>

extern char** environ;

namespace mhla {

const std::vector<std::string_view>& kernel_switch_names() {
  static const std::vector<std::string_view> names = {"MHLA_BIDIRECTIONAL_KERNEL",
                                                      "MHLA_CAUSAL_LEAN_PASSES",
                                                      "MHLA_CAUSAL_MIX_GEMM",
                                                      "MHLA_CAUSAL_PACKED_PREFIX",
                                                      "MHLA_CAUSAL_PACKED_STATES",
                                                      "MHLA_CLUSTER_PERSISTENT",
                                                      "MHLA_DECODE_VEC",
                                                      "MHLA_DELTA_GRADS_PERSISTENT",
                                                      "MHLA_DELTA_STATE_SLICE",
                                                      "MHLA_DELTA_WALK_BUFFERS",
                                                      "MHLA_DELTA_WALK_SEGMENTS",
                                                      "MHLA_DEPENDENT_LAUNCH",
                                                      "MHLA_FRAGMENT_ONE_TILE",
                                                      "MHLA_FRAGMENT_PASSES",
                                                      "MHLA_FUSED_ADALN",
                                                      "MHLA_FUSED_CE",
                                                      "MHLA_FUSED_GATED_NORM",
                                                      "MHLA_FUSED_GRID_CONV",
                                                      "MHLA_FUSED_MIX_BACKWARD",
                                                      "MHLA_FUSED_MLP",
                                                      "MHLA_FUSED_MLP_BACKWARD",
                                                      "MHLA_FUSED_NORM",
                                                      "MHLA_FUSED_QKV_ROTARY",
                                                      "MHLA_FUSED_RESIDUAL_NORM",
                                                      "MHLA_FUSED_SHORT_CONV",
                                                      "MHLA_KEY_PASS_CTAS",
                                                      "MHLA_LINEAR_BIAS_KERNEL",
                                                      "MHLA_MIX_BACKWARD_STORES",
                                                      "MHLA_MIX_GRID",
                                                      "MHLA_MIX_ORDER",
                                                      "MHLA_PACKED_BLOCK_STATES",
                                                      "MHLA_PACKED_STATE_MIX",
                                                      "MHLA_PACKED_STATE_SETS",
                                                      "MHLA_PACKED_STATE_STORES",
                                                      "MHLA_PAIR_PRODUCTS_SHARED",
                                                      "MHLA_PIPELINED_CHUNKS",
                                                      "MHLA_PIPELINED_PASSES",
                                                      "MHLA_QUERY_PASS_CTAS",
                                                      "MHLA_RESIDENT_BACKWARD",
                                                      "MHLA_RESIDENT_FORWARD",
                                                      "MHLA_RESIDENT_STATE_BACKWARD",
                                                      "MHLA_SCALAR_STATE_ADDS",
                                                      "MHLA_SEQUENCE_FORWARD",
                                                      "MHLA_SHORT_CONV_GROUP",
                                                      "MHLA_STATE_MIX",
                                                      "MHLA_SWEEP_AHEAD",
                                                      "MHLA_WARPGROUP_FORWARD_GROUPS",
                                                      "MHLA_WARPGROUP_KEY_TILE"};
  return names;
}

namespace {

// MHLA_* variables that are not kernel switches: where the data and the staged binaries are.
bool is_path_setting(std::string_view name) {
  return name == "MHLA_DATA_DIR" || name == "MHLA_BIN" || name == "MHLA_TESTS_BIN";
}

bool is_known_switch(std::string_view name) {
  const auto& names = kernel_switch_names();
  return std::find(names.begin(), names.end(), name) != names.end();
}

struct Setting {
  std::string name, value;
};

// The MHLA_* variables of the environment other than the paths, sorted by name.
std::vector<Setting> mhla_settings() {
  std::vector<Setting> out;
  for (char** entry = environ; entry != nullptr && *entry != nullptr; ++entry) {
    const std::string_view text(*entry);
    const auto equals = text.find('=');
    if (equals == std::string_view::npos || !text.starts_with("MHLA_")) continue;
    const auto name = text.substr(0, equals);
    if (is_path_setting(name)) continue;
    out.push_back({std::string(name), std::string(text.substr(equals + 1))});
  }
  std::sort(out.begin(), out.end(),
            [](const Setting& a, const Setting& b) { return a.name < b.name; });
  return out;
}

}  // namespace

std::string environment_switches_set() {
  std::string out;
  for (const auto& [name, value] : mhla_settings()) {
    if (!out.empty()) out += ", ";
    out += name + "=" + value;
    if (!is_known_switch(name)) out += " (unknown)";
  }
  return out;
}

std::vector<std::string> unknown_environment_switches() {
  std::vector<std::string> out;
  for (const auto& setting : mhla_settings())
    if (!is_known_switch(setting.name)) out.push_back(setting.name);
  return out;
}

}  // namespace mhla
