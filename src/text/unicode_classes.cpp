#include <algorithm>

#include "text/unicode_tables.h"

namespace mhla::unicode {
namespace {

bool in_ranges(const CodeRange* ranges, size_t size, uint32_t cp) {
  const CodeRange* end = ranges + size;
  const CodeRange* it = std::upper_bound(ranges, end, cp, [](uint32_t value, const CodeRange& r) {
    return value < r.first;
  });
  return it != ranges && cp <= (it - 1)->last;
}

}  // namespace

bool is_letter(uint32_t cp) { return in_ranges(kLetters, kLetters_size, cp); }
bool is_number(uint32_t cp) { return in_ranges(kNumbers, kNumbers_size, cp); }
bool is_space(uint32_t cp) { return in_ranges(kSpaces, kSpaces_size, cp); }

}  // namespace mhla::unicode
