#include "train/stop_signal.h"

#include <atomic>
#include <csignal>

namespace mhla {
namespace {

std::atomic<int> requested{0};

extern "C" void on_stop_signal(int signal) {
  if (requested.exchange(signal) != 0) {
    std::signal(signal, SIG_DFL);
    std::raise(signal);
  }
}

}  // namespace

void install_stop_handlers() {
  struct sigaction action {};
  action.sa_handler = on_stop_signal;
  sigemptyset(&action.sa_mask);
  sigaction(SIGINT, &action, nullptr);
  sigaction(SIGTERM, &action, nullptr);
}

int stop_requested() { return requested.load(); }
void clear_stop_request() { requested.store(0); }

}  // namespace mhla
