#pragma once
namespace mhla {
// Fills every registry once (models, attention types, datasets, optimizers, schedules).
void register_builtins();
}  // namespace mhla
