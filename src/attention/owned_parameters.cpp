#include "attention/owned_parameters.h"

#include <array>
#include <string_view>

namespace mhla {

bool attention_owns_init(const std::string& parameter_name) {
  static constexpr std::array<std::string_view, 3> kOwned = {"mixing", "A_log", "dt_bias"};
  const auto dot = parameter_name.rfind('.');
  const std::string_view leaf =
      std::string_view(parameter_name).substr(dot == std::string::npos ? 0 : dot + 1);
  for (auto owned : kOwned) {
    if (leaf == owned) return true;
  }
  return false;
}

}  // namespace mhla
