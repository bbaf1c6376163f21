#pragma once
// GPT-2's pre-tokenizer: splits text into the pieces BPE works on, as the pattern
//   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
// does (first alternative that matches, each greedy). Works on UTF-8; a byte that is not valid
// UTF-8 counts as one "other" character, so every input splits and round-trips.
#include <string_view>
#include <vector>

namespace mhla {

std::vector<std::string_view> gpt2_pretokenize(std::string_view text);

}  // namespace mhla
