#pragma once
// The names in each registry, for config validation (implemented beside the registrations in
// builtins.cpp, so that core/ does not depend on the modules that fill the registries).
#include <string>
#include <vector>

namespace mhla {

// registry: "model", "attention", "dataset", "optimizer" or "schedule".
std::vector<std::string> registered_names(const std::string& registry);

}  // namespace mhla
