#include "text/pretokenizer.h"

#include <cstdint>

#include "text/unicode_tables.h"

namespace mhla {
namespace {

enum class CharClass { kLetter, kNumber, kSpace, kOther };

struct Char {
  size_t begin, end;  // byte range
  uint32_t cp;
  CharClass cls;
};

// Decodes one UTF-8 character at `at`; invalid sequences yield a single byte of class kOther.
Char decode(std::string_view s, size_t at) {
  const auto byte = [&](size_t i) { return static_cast<uint8_t>(s[i]); };
  const uint8_t b0 = byte(at);
  uint32_t cp = b0;
  size_t length = 1;
  if (b0 >= 0xC2 && b0 <= 0xF4) {
    length = b0 < 0xE0 ? 2 : (b0 < 0xF0 ? 3 : 4);
    if (at + length > s.size()) {
      length = 1;
    } else {
      cp = b0 & (0xFF >> (length + 1));
      for (size_t i = 1; i < length; ++i) {
        const uint8_t b = byte(at + i);
        if ((b & 0xC0) != 0x80) {
          length = 1;
          break;
        }
        cp = (cp << 6) | (b & 0x3F);
      }
      // Overlong forms, surrogates and out-of-range values are invalid too.
      const uint32_t minimum[] = {0, 0, 0x80, 0x800, 0x10000};
      if (length > 1 && (cp < minimum[length] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF))) {
        length = 1;
      }
    }
    if (length == 1) cp = 0xFFFFFFFF;
  } else if (b0 >= 0x80) {
    cp = 0xFFFFFFFF;  // a continuation or invalid lead byte on its own
  }
  CharClass cls = CharClass::kOther;
  if (cp != 0xFFFFFFFF) {
    if (unicode::is_letter(cp)) cls = CharClass::kLetter;
    else if (unicode::is_number(cp)) cls = CharClass::kNumber;
    else if (unicode::is_space(cp)) cls = CharClass::kSpace;
  }
  return {at, at + length, cp, cls};
}

}  // namespace

std::vector<std::string_view> gpt2_pretokenize(std::string_view text) {
  std::vector<Char> chars;
  for (size_t at = 0; at < text.size();) {
    chars.push_back(decode(text, at));
    at = chars.back().end;
  }
  std::vector<std::string_view> pieces;
  const size_t n = chars.size();
  auto emit = [&](size_t from, size_t to) {  // chars [from, to)
    pieces.push_back(text.substr(chars[from].begin, chars[to - 1].end - chars[from].begin));
  };
  auto run_of = [&](size_t from, CharClass cls) {
    size_t j = from;
    while (j < n && chars[j].cls == cls) ++j;
    return j;
  };
  size_t i = 0;
  while (i < n) {
    // 's 't 're 've 'm 'll 'd
    if (chars[i].cp == '\'' && i + 1 < n) {
      const uint32_t c1 = chars[i + 1].cp;
      if (c1 == 's' || c1 == 't' || c1 == 'm' || c1 == 'd') {
        emit(i, i + 2);
        i += 2;
        continue;
      }
      if (i + 2 < n) {
        const uint32_t c2 = chars[i + 2].cp;
        if ((c1 == 'r' && c2 == 'e') || (c1 == 'v' && c2 == 'e') || (c1 == 'l' && c2 == 'l')) {
          emit(i, i + 3);
          i += 3;
          continue;
        }
      }
    }
    // ' ?\p{L}+', ' ?\p{N}+', ' ?[^\s\p{L}\p{N}]+'
    const size_t body = (chars[i].cp == ' ' && i + 1 < n) ? i + 1 : i;
    const CharClass cls = chars[body].cls;
    if (cls != CharClass::kSpace) {
      const size_t end = run_of(body, cls);
      emit(i, end);
      i = end;
      continue;
    }
    // '\s+(?!\S)' then '\s+': a whitespace run followed by a non-space gives up its last char.
    const size_t end = run_of(i, CharClass::kSpace);
    if (end == n || end - i == 1) {
      emit(i, end);
      i = end;
    } else {
      emit(i, end - 1);
      i = end - 1;
    }
  }
  return pieces;
}

}  // namespace mhla
