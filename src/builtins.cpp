// The one place where everything the framework offers is registered.
#include "builtins.h"

#include <mutex>

#include "attention/registrations.h"
#include "core/error.h"
#include "core/registered_names.h"
#include "data/image_dataset.h"
#include "models/deit.h"
#include "models/cnn.h"
#include "models/dit.h"
#include "models/gpt.h"
#include "train/optimizer.h"
#include "train/schedule.h"
#include "train/task.h"

namespace mhla {

void register_builtins() {
  static std::once_flag once;
  std::call_once(once, [] {
    auto& attention = attention_registry();
    register_softmax_attention(attention);
    register_linear_attention(attention);
    register_mhla_attention(attention);
    register_gated_delta_attention(attention);

    register_deit(model_registry());
    register_gpt(model_registry());
    register_dit(model_registry());
    register_cnn(model_registry());

    register_fashion_mnist(dataset_registry());
    register_synthetic_images(dataset_registry());

    register_adamw(optimizer_registry());
    register_sgd(optimizer_registry());

    register_schedules(schedule_registry());

    register_classification_task(task_registry());
    register_language_model_task(task_registry());
    register_diffusion_task(task_registry());
  });
}

std::vector<std::string> registered_names(const std::string& registry) {
  register_builtins();
  if (registry == "model") return model_registry().names();
  if (registry == "attention") return attention_registry().names();
  if (registry == "dataset") return dataset_registry().names();
  if (registry == "optimizer") return optimizer_registry().names();
  if (registry == "schedule") return schedule_registry().names();
  fail("internal: no registry named '{}'", registry);
}

}  // namespace mhla
