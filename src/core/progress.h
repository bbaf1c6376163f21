#pragma once
// What long jobs print in their progress lines: durations ("45s", "3m07s", "2h05m"; "?" when not
// known) and "R unit/s, ETA D" from the items done so far.
#include <cstdint>
#include <string>

namespace mhla {

std::string format_duration(double seconds);

// done of total items finished `elapsed` seconds after the start: e.g. "120 img/s, ETA 1m07s".
std::string rate_and_eta(int64_t done, int64_t total, double elapsed, const std::string& unit);

}  // namespace mhla
