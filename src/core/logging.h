#pragma once
// The run's log: every line goes to stdout and, once a run folder is open, to its log.txt, with a
// timestamp. (Our own few lines rather than spdlog: Debian 12's spdlog 1.10 does not compile
// against its fmt 9 in C++20 mode.)
#include <string>

#include <fmt/format.h>

namespace mhla {

class Logger {
 public:
  template <typename... Args>
  void info(fmt::format_string<Args...> format, Args&&... args) {
    write(fmt::format(format, std::forward<Args>(args)...));
  }
  void write(const std::string& line);
};

Logger& logger();
// Appends every later line to <run_dir>/log.txt too.
void open_run_log(const std::string& run_dir);
void close_run_log();

}  // namespace mhla
