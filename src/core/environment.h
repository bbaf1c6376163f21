#pragma once
// On/off switches read from the environment, for A/B comparisons of kernels in one binary
// (MHLA_FUSED_NORM=0, MHLA_LINEAR_BIAS_KERNEL=0): "0" is off, "1" is on, anything else or unset
// is the default. Callers keep the answer in a static (read once per process).
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

namespace mhla {

inline bool environment_switch(const char* name, bool default_on) {
  const char* value = std::getenv(name);
  if (value == nullptr) return default_on;
  if (std::strcmp(value, "0") == 0) return false;
  if (std::strcmp(value, "1") == 0) return true;
  return default_on;
}

// A kernel switch some part of this build reads, with the values the reading code compares
// against ('|'-separated; "<count>": a positive integer; "<passes>": "0" or a comma list of
// states, output, query, key). Any other value leaves the default in place.
struct KernelSwitch {
  std::string_view name, values;
  bool reads(std::string_view value) const;
};

// Every one, sorted by name (the README's "Kernel switches" lists them;
// scripts/tests/test_kernel_switches.py checks both against the sources).
const std::vector<KernelSwitch>& kernel_switches();
const std::vector<std::string_view>& kernel_switch_names();

// "NAME=value, ..." for the MHLA_* variables set in the environment, "" when none is: runs and
// benchmarks record it, so a run folder or a bench line says when a kernel was swapped out. Every
// MHLA_* name counts except the paths the scripts and data loaders read (MHLA_DATA_DIR,
// MHLA_BIN, MHLA_TESTS_BIN); a name that no part of the build reads is marked "(unknown)", so a
// misspelt switch shows instead of silently changing nothing; a value the switch does not read is
// marked "(value not read)".
std::string environment_switches_set();

// One line per MHLA_* variable that changes nothing: a name no part of this build reads, or a
// value its switch does not read (sorted by name).
std::vector<std::string> environment_switch_warnings();

}  // namespace mhla
