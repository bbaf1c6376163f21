#pragma once
// SIGINT / SIGTERM ask the trainer to stop after the current step, write checkpoints/last and
// exit cleanly. A second signal of either kind ends the process at once (writes are atomic, so
// nothing half-written is left behind).
namespace mhla {

void install_stop_handlers();
// The signal that asked for a stop, or 0.
int stop_requested();
void clear_stop_request();

}  // namespace mhla
