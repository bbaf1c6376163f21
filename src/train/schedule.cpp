#include "train/schedule.h"

#include <algorithm>
#include <cmath>

namespace mhla {
namespace {

// Fraction of the post-warmup phase done, or -1 during warmup (lr then ramps linearly).
double decay_progress(const ScheduleSpec& s, int64_t step) {
  if (step < s.warmup_steps) return -1.0;
  const int64_t span = std::max<int64_t>(1, s.total_steps - s.warmup_steps - 1);
  return std::min(1.0, static_cast<double>(step - s.warmup_steps) / static_cast<double>(span));
}

double warmup_lr(const ScheduleSpec& s, int64_t step) {
  return s.peak_lr * static_cast<double>(step + 1) / static_cast<double>(s.warmup_steps);
}

}  // namespace

Registry<ScheduleEntry>& schedule_registry() {
  static Registry<ScheduleEntry> registry("schedule");
  return registry;
}

void register_schedules(Registry<ScheduleEntry>& registry) {
  registry.add("cosine", {"linear warmup, then cosine decay to min_lr",
                          [](const ScheduleSpec& s, int64_t step) {
                            double p = decay_progress(s, step);
                            if (p < 0) return warmup_lr(s, step);
                            return s.min_lr +
                                   (s.peak_lr - s.min_lr) * 0.5 * (1.0 + std::cos(M_PI * p));
                          }});
  registry.add("linear", {"linear warmup, then linear decay to min_lr",
                          [](const ScheduleSpec& s, int64_t step) {
                            double p = decay_progress(s, step);
                            if (p < 0) return warmup_lr(s, step);
                            return s.min_lr + (s.peak_lr - s.min_lr) * (1.0 - p);
                          }});
  registry.add("constant", {"linear warmup, then constant peak lr",
                            [](const ScheduleSpec& s, int64_t step) {
                              return decay_progress(s, step) < 0 ? warmup_lr(s, step) : s.peak_lr;
                            }});
}

}  // namespace mhla
