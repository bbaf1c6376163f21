#include "attention/attention_type.h"

namespace mhla {

Registry<AttentionType>& attention_registry() {
  static Registry<AttentionType> registry("attention type");
  return registry;
}

const OpFn& select_backend(const std::string& type_name, const AttentionType& type,
                           const std::string& backend, const torch::Device& device,
                           const std::string& where, bool causal) {
  auto list_backends = [&] {
    std::string names;
    for (const auto& [name, fn] : type.backends) names += (names.empty() ? "" : ", ") + name;
    return names;
  };
  if (backend == "auto") {
    if (device.is_cuda()) {
      for (const auto& preferred : type.gpu_preference) {
        auto it = type.backends.find(preferred);
        if (it != type.backends.end() && !(causal && type.bidirectional_only.count(preferred))) {
          return it->second;
        }
      }
    }
    return type.backends.at("reference");
  }
  auto it = type.backends.find(backend);
  if (it == type.backends.end()) {
    fail("{}: attention type '{}' has no backend '{}' in this build; available: {}", where,
         type_name, backend, list_backends());
  }
  if (causal && type.bidirectional_only.count(backend)) {
    fail("{}: backend '{}' of attention type '{}' implements the bidirectional op only; causal "
         "layers run on 'reference' (or say backend: auto)",
         where, backend, type_name);
  }
  if (backend != "reference" && !device.is_cuda()) {
    fail("{}: backend '{}' of attention type '{}' needs a CUDA device, the run is on {}", where,
         backend, type_name, device.str());
  }
  return it->second;
}

}  // namespace mhla
