#pragma once
// On/off switches read from the environment, for A/B comparisons of kernels in one binary
// (MHLA_FUSED_NORM=0, MHLA_LINEAR_BIAS_KERNEL=1): "0" is off, "1" is on, anything else or unset
// is the default. Callers keep the answer in a static (read once per process).
#include <cstdlib>
#include <cstring>

namespace mhla {

inline bool environment_switch(const char* name, bool default_on) {
  const char* value = std::getenv(name);
  if (value == nullptr) return default_on;
  if (std::strcmp(value, "0") == 0) return false;
  if (std::strcmp(value, "1") == 0) return true;
  return default_on;
}

}  // namespace mhla
