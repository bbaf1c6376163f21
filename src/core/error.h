#pragma once
// One exception type for every user-facing failure (bad config, bad data file, bad checkpoint,
// bad CLI argument). The CLI prints what() as a single line and exits nonzero.
#include <stdexcept>
#include <string>

#include <fmt/format.h>

namespace mhla {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message) : std::runtime_error(message) {}
};

template <typename... Args>
[[noreturn]] void fail(fmt::format_string<Args...> format, Args&&... args) {
  throw Error(fmt::format(format, std::forward<Args>(args)...));
}

}  // namespace mhla
