#pragma once
// Learning-rate schedules: linear warmup, then a decay to schedule.min_lr at the last step.
#include <functional>
#include <string>

#include "core/registry.h"

namespace mhla {

struct ScheduleSpec {
  double peak_lr = 1e-3, min_lr = 0.0;
  int64_t warmup_steps = 0, total_steps = 1;
};

struct ScheduleEntry {
  std::string description;
  std::function<double(const ScheduleSpec&, int64_t step)> lr;  // step counts from 0
};

Registry<ScheduleEntry>& schedule_registry();
void register_schedules(Registry<ScheduleEntry>& registry);

}  // namespace mhla
