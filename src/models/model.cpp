#include "models/model.h"

#include "attention/attention_layer.h"
#include "core/error.h"

namespace mhla {

void Model::project_parameters() {
  for (const auto& module : modules(/*include_self=*/false)) {
    if (auto* projected = dynamic_cast<ProjectedModule*>(module.get())) {
      projected->project_parameters();
    }
  }
}

torch::Tensor Model::features(const torch::Tensor&) {
  throw Error("this model has no feature representation");
}

int64_t Model::parameter_count() {
  int64_t count = 0;
  for (const auto& p : parameters()) count += p.numel();
  return count;
}

Registry<ModelEntry>& model_registry() {
  static Registry<ModelEntry> registry("model");
  return registry;
}

}  // namespace mhla
