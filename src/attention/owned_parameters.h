#pragma once
// Parameters an attention layer initializes itself (MHLA's mixing matrix, the delta rule's
// A_log and dt_bias): a model's generic weight init must leave them alone. One list, so a new
// attention type with its own parameters is added here and every model respects it.
#include <string>

namespace mhla {

bool attention_owns_init(const std::string& parameter_name);

}  // namespace mhla
