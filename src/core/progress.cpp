#include "core/progress.h"

#include <cmath>

#include <fmt/format.h>

namespace mhla {

std::string format_duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  const auto s = static_cast<int64_t>(seconds + 0.5);
  if (s >= 3600) return fmt::format("{}h{:02d}m", s / 3600, (s % 3600) / 60);
  if (s >= 60) return fmt::format("{}m{:02d}s", s / 60, s % 60);
  return fmt::format("{}s", s);
}

std::string rate_and_eta(int64_t done, int64_t total, double elapsed, const std::string& unit) {
  if (done <= 0 || elapsed <= 0) return fmt::format("? {}/s, ETA ?", unit);
  const double rate = static_cast<double>(done) / elapsed;
  return fmt::format("{:.0f} {}/s, ETA {}", rate, unit,
                     format_duration(static_cast<double>(total - done) / rate));
}

}  // namespace mhla
