#include "core/environment.h"

#include <algorithm>
#include <cctype>

extern char** environ;

namespace mhla {

// Values as the reading code compares them (README, "Kernel switches"): on/off switches read "0"
// and "1"; the others the forms they pick.
const std::vector<KernelSwitch>& kernel_switches() {
  // clang-format off
  static const std::vector<KernelSwitch> switches = {
      {"MHLA_BIDIRECTIONAL_KERNEL", "cluster|states"},
      {"MHLA_CAUSAL_LEAN_PASSES", "0|1"},
      {"MHLA_CAUSAL_MIX_GEMM", "0|1"},
      {"MHLA_CAUSAL_PACKED_PREFIX", "0|1"},
      {"MHLA_CAUSAL_PACKED_STATES", "0|1"},
      {"MHLA_CLUSTER_PERSISTENT", "0|1"},
      {"MHLA_DECODE_VEC", "1|2|4"},
      {"MHLA_DELTA_GRADS_PERSISTENT", "0|1"},
      {"MHLA_DELTA_STATE_SLICE", "16|32"},
      {"MHLA_DELTA_WALK_BUFFERS", "1|2"},
      {"MHLA_DELTA_WALK_SEGMENTS", "<count>"},
      {"MHLA_DEPENDENT_LAUNCH", "0|1"},
      {"MHLA_FRAGMENT_ONE_TILE", "0|1"},
      {"MHLA_FRAGMENT_PASSES", "<passes>"},
      {"MHLA_FUSED_ADALN", "0|1"},
      {"MHLA_FUSED_CE", "0|1"},
      {"MHLA_FUSED_GATED_NORM", "0|1"},
      {"MHLA_FUSED_GRID_CONV", "0|1"},
      {"MHLA_FUSED_MIX_BACKWARD", "0|1"},
      {"MHLA_FUSED_MLP", "0|1"},
      {"MHLA_FUSED_MLP_BACKWARD", "epilogue|kernel|bgrad"},
      {"MHLA_FUSED_NORM", "0|1"},
      {"MHLA_FUSED_QKV_ROTARY", "0|1"},
      {"MHLA_FUSED_RESIDUAL_NORM", "0|1"},
      {"MHLA_FUSED_SHORT_CONV", "0|1"},
      {"MHLA_KEY_PASS_CTAS", "3|4"},
      {"MHLA_LINEAR_BIAS_KERNEL", "0|1"},
      {"MHLA_MIX_BACKWARD_STORES", "direct"},
      {"MHLA_MIX_GRID", "resident"},
      {"MHLA_MIX_ORDER", "forward"},
      {"MHLA_PACKED_BLOCK_STATES", "0|1"},
      {"MHLA_PACKED_STATE_MIX", "simt"},
      {"MHLA_PACKED_STATE_SETS", "0|1"},
      {"MHLA_PACKED_STATE_STORES", "direct"},
      {"MHLA_PAIR_PRODUCTS_SHARED", "0|1"},
      {"MHLA_PIPELINED_CHUNKS", "0|1"},
      {"MHLA_PIPELINED_PASSES", "0|1"},
      {"MHLA_QUERY_PASS_CTAS", "3|4"},
      {"MHLA_RESIDENT_BACKWARD", "state|scores"},
      {"MHLA_RESIDENT_FORWARD", "mma"},
      {"MHLA_RESIDENT_STATE_BACKWARD", "0|1"},
      {"MHLA_SCALAR_STATE_ADDS", "0|1"},
      {"MHLA_SEQUENCE_FORWARD", "0|1"},
      {"MHLA_SHORT_CONV_GROUP", "1|2|4"},
      {"MHLA_STATE_MIX", "group16|group8x5"},
      {"MHLA_SWEEP_AHEAD", "1|3|7|15"},
      {"MHLA_WARPGROUP_FORWARD_GROUPS", "2"},
      {"MHLA_WARPGROUP_KEY_TILE", "64"}};
  // clang-format on
  return switches;
}

const std::vector<std::string_view>& kernel_switch_names() {
  static const std::vector<std::string_view> names = [] {
    std::vector<std::string_view> out;
    for (const auto& s : kernel_switches()) out.push_back(s.name);
    return out;
  }();
  return names;
}

namespace {

// The pieces of `text` between `separator`s (an empty text is one empty piece).
std::vector<std::string_view> pieces(std::string_view text, char separator) {
  std::vector<std::string_view> out;
  for (size_t start = 0;;) {
    const size_t end = std::min(text.find(separator, start), text.size());
    out.push_back(text.substr(start, end - start));
    if (end == text.size()) return out;
    start = end + 1;
  }
}

}  // namespace

bool KernelSwitch::reads(std::string_view value) const {
  if (values == "<count>") {
    return !value.empty() && value.size() < 10 && value[0] != '0' &&
           std::all_of(value.begin(), value.end(), [](char c) { return std::isdigit(c) != 0; });
  }
  if (values == "<passes>") {  // "0", or a comma list of pass names
    if (value == "0") return true;
    const auto passes = pieces(value, ',');
    return std::all_of(passes.begin(), passes.end(), [](std::string_view pass) {
      return pass == "states" || pass == "output" || pass == "query" || pass == "key";
    });
  }
  const auto accepted = pieces(values, '|');
  return std::find(accepted.begin(), accepted.end(), value) != accepted.end();
}

namespace {

// MHLA_* variables that are not kernel switches: where the data and the staged binaries are.
bool is_path_setting(std::string_view name) {
  return name == "MHLA_DATA_DIR" || name == "MHLA_BIN" || name == "MHLA_TESTS_BIN";
}

const KernelSwitch* find_switch(std::string_view name) {
  const auto& switches = kernel_switches();
  const auto it = std::find_if(switches.begin(), switches.end(),
                               [&](const KernelSwitch& s) { return s.name == name; });
  return it == switches.end() ? nullptr : &*it;
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

std::string readable_values(std::string_view values) {
  if (values == "<count>") return "a positive count";
  if (values == "<passes>") return "0 or a comma list of states, output, query, key";
  std::string out(values);
  std::replace(out.begin(), out.end(), '|', ',');
  return out;
}

}  // namespace

std::string environment_switches_set() {
  std::string out;
  for (const auto& [name, value] : mhla_settings()) {
    if (!out.empty()) out += ", ";
    out += name + "=" + value;
    const KernelSwitch* known = find_switch(name);
    if (known == nullptr) {
      out += " (unknown)";
    } else if (!known->reads(value)) {
      out += " (value not read)";
    }
  }
  return out;
}

std::vector<std::string> environment_switch_warnings() {
  std::vector<std::string> out;
  for (const auto& [name, value] : mhla_settings()) {
    const KernelSwitch* known = find_switch(name);
    if (known == nullptr) {
      out.push_back(name + " is set but no kernel of this build reads it (a misspelt switch?)");
    } else if (!known->reads(value)) {
      out.push_back(name + "=" + value + " is not a value it reads (" +
                    readable_values(known->values) + "); the default stays");
    }
  }
  return out;
}

}  // namespace mhla
