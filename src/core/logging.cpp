#include "core/logging.h"

#include <chrono>
#include <cstdio>
#include <ctime>
#include <mutex>

#include "core/error.h"

namespace mhla {
namespace {

std::mutex log_mutex;
std::FILE* run_log = nullptr;

std::string timestamp() {
  const std::time_t now = std::chrono::system_clock::to_time_t(std::chrono::system_clock::now());
  std::tm local{};
  localtime_r(&now, &local);
  char buffer[32];
  std::strftime(buffer, sizeof buffer, "%Y-%m-%d %H:%M:%S", &local);
  return buffer;
}

}  // namespace

void Logger::write(const std::string& line) {
  const std::string stamped = "[" + timestamp() + "] " + line + "\n";
  std::lock_guard<std::mutex> lock(log_mutex);
  std::fputs(stamped.c_str(), stdout);
  std::fflush(stdout);
  if (run_log) {
    std::fputs(stamped.c_str(), run_log);
    std::fflush(run_log);
  }
}

Logger& logger() {
  static Logger instance;
  return instance;
}

void open_run_log(const std::string& run_dir) {
  close_run_log();
  const std::string path = run_dir + "/log.txt";
  std::lock_guard<std::mutex> lock(log_mutex);
  run_log = std::fopen(path.c_str(), "a");
  if (!run_log) fail("{}: cannot open the run log", path);
}

void close_run_log() {
  std::lock_guard<std::mutex> lock(log_mutex);
  if (run_log) std::fclose(run_log);
  run_log = nullptr;
}

}  // namespace mhla
