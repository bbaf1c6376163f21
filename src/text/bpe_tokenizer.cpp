#include "text/bpe_tokenizer.h"

#include <fstream>
#include <limits>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

#include "core/atomic_file.h"
#include "core/error.h"
#include "text/pretokenizer.h"

namespace mhla {
namespace {

constexpr const char* kEndOfText = "<|endoftext|>";
constexpr const char* kFormat = "mhla-bpe 1";

// GPT-2's reversible byte -> printable code point map (so merges files hold no raw bytes).
std::vector<uint32_t> gpt2_byte_to_codepoint() {
  std::vector<uint32_t> map(256, 0);
  std::vector<bool> direct(256, false);
  for (int b = '!'; b <= '~'; ++b) direct[b] = true;
  for (int b = 0xA1; b <= 0xAC; ++b) direct[b] = true;
  for (int b = 0xAE; b <= 0xFF; ++b) direct[b] = true;
  uint32_t next = 256;
  for (int b = 0; b < 256; ++b) map[b] = direct[b] ? static_cast<uint32_t>(b) : next++;
  return map;
}

std::string utf8(uint32_t cp) {
  std::string out;
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
  return out;
}

// Replaces every non-overlapping (left, right), scanning left to right, by `merged`.
void merge_pair(std::vector<int32_t>& word, int32_t left, int32_t right, int32_t merged) {
  size_t out = 0;
  for (size_t i = 0; i < word.size(); ++i) {
    if (i + 1 < word.size() && word[i] == left && word[i + 1] == right) {
      word[out++] = merged;
      ++i;
    } else {
      word[out++] = word[i];
    }
  }
  word.resize(out);
}

}  // namespace

void BpeTokenizer::index_tokens() {
  cache_.clear();
  for (int b = 0; b < 256; ++b) {
    if (byte_ids_[b] < 0) fail("tokenizer: byte {} has no token", b);
  }
}

void BpeTokenizer::encode_piece(std::string_view piece, std::vector<int32_t>& out) const {
  auto cached = cache_.find(std::string(piece));
  if (cached != cache_.end()) {
    out.insert(out.end(), cached->second.begin(), cached->second.end());
    return;
  }
  std::vector<int32_t> word;
  word.reserve(piece.size());
  for (unsigned char c : piece) word.push_back(byte_ids_[c]);
  while (word.size() > 1) {
    // The adjacent pair with the lowest rank; merge all its non-overlapping occurrences.
    int32_t best_rank = std::numeric_limits<int32_t>::max();
    size_t best_at = 0;
    for (size_t i = 0; i + 1 < word.size(); ++i) {
      auto it = merges_.find(pair_key(word[i], word[i + 1]));
      if (it != merges_.end() && it->second.rank < best_rank) {
        best_rank = it->second.rank;
        best_at = i;
      }
    }
    if (best_rank == std::numeric_limits<int32_t>::max()) break;
    const int32_t left = word[best_at], right = word[best_at + 1];
    merge_pair(word, left, right, merges_.at(pair_key(left, right)).result);
  }
  if (cache_.size() < 1000000) cache_.emplace(std::string(piece), word);
  out.insert(out.end(), word.begin(), word.end());
}

std::vector<int32_t> BpeTokenizer::encode(std::string_view text) const {
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 1);
  for (auto piece : gpt2_pretokenize(text)) encode_piece(piece, ids);
  return ids;
}

std::string BpeTokenizer::decode(const std::vector<int32_t>& ids) const {
  std::string out;
  for (int32_t id : ids) {
    if (id < 0 || id >= vocab_size()) fail("tokenizer: id {} is outside the vocabulary of {}", id, vocab_size());
    out += tokens_[id];
  }
  return out;
}

std::optional<int32_t> BpeTokenizer::special(const std::string& name) const {
  auto it = specials_.find(name);
  if (it == specials_.end()) return std::nullopt;
  return it->second;
}

BpeTokenizer BpeTokenizer::train(const std::vector<std::string>& texts, int64_t vocab_size,
                                 const std::function<void(int64_t, int64_t)>& progress) {
  if (vocab_size < 257 || vocab_size > (1 << 30)) {
    fail("tokenizer: vocabulary size {} must be at least 257 (256 bytes + <|endoftext|>)", vocab_size);
  }
  BpeTokenizer t;
  for (int b = 0; b < 256; ++b) {
    t.tokens_.push_back(std::string(1, static_cast<char>(b)));
    t.byte_ids_[b] = b;
  }
  // Unique pre-tokenizer pieces with their counts; each becomes a word of symbol ids.
  std::unordered_map<std::string, int64_t> counts;
  for (const auto& text : texts) {
    for (auto piece : gpt2_pretokenize(text)) ++counts[std::string(piece)];
  }
  std::vector<std::vector<int32_t>> words;
  std::vector<int64_t> word_counts;
  for (const auto& [piece, count] : counts) {
    std::vector<int32_t> word;
    for (unsigned char c : piece) word.push_back(c);
    words.push_back(std::move(word));
    word_counts.push_back(count);
  }
  // Pair statistics, updated incrementally: count of each pair and the words it occurs in.
  std::unordered_map<uint64_t, int64_t> pair_counts;
  std::unordered_map<uint64_t, std::set<size_t>> pair_words;
  for (size_t w = 0; w < words.size(); ++w) {
    for (size_t i = 0; i + 1 < words[w].size(); ++i) {
      const uint64_t key = pair_key(words[w][i], words[w][i + 1]);
      pair_counts[key] += word_counts[w];
      pair_words[key].insert(w);
    }
  }
  // A max-heap keyed by (count, -key) with lazy deletion.
  std::set<std::pair<int64_t, uint64_t>, std::greater<>> heap;
  auto key_order = [](uint64_t key) { return std::numeric_limits<uint64_t>::max() - key; };
  for (const auto& [key, count] : pair_counts) heap.insert({count, key_order(key)});
  const int64_t merges_wanted = vocab_size - 256 - 1;
  while (static_cast<int64_t>(t.merge_list_.size()) < merges_wanted && !heap.empty()) {
    auto [count, ordered] = *heap.begin();
    heap.erase(heap.begin());
    const uint64_t key = std::numeric_limits<uint64_t>::max() - ordered;
    auto current = pair_counts.find(key);
    if (current == pair_counts.end() || current->second != count) continue;  // stale entry
    if (count <= 0) break;
    const int32_t left = static_cast<int32_t>(key >> 32), right = static_cast<int32_t>(key & 0xFFFFFFFF);
    const int32_t merged = static_cast<int32_t>(t.tokens_.size());
    t.tokens_.push_back(t.tokens_[left] + t.tokens_[right]);
    t.merges_[key] = {static_cast<int32_t>(t.merge_list_.size()), merged};
    t.merge_list_.push_back({left, right});
    std::set<uint64_t> touched;
    auto affected = pair_words[key];
    for (size_t w : affected) {
      auto& word = words[w];
      const int64_t c = word_counts[w];
      // Remove this word's pairs, rewrite it, add its pairs back.
      for (size_t i = 0; i + 1 < word.size(); ++i) {
        const uint64_t k = pair_key(word[i], word[i + 1]);
        pair_counts[k] -= c;
        touched.insert(k);
      }
      for (size_t i = 0; i + 1 < word.size(); ++i) pair_words[pair_key(word[i], word[i + 1])].erase(w);
      merge_pair(word, left, right, merged);
      for (size_t i = 0; i + 1 < word.size(); ++i) {
        const uint64_t k = pair_key(word[i], word[i + 1]);
        pair_counts[k] += c;
        pair_words[k].insert(w);
        touched.insert(k);
      }
    }
    for (uint64_t k : touched) {
      if (pair_counts[k] > 0) heap.insert({pair_counts[k], key_order(k)});
    }
    if (progress) progress(static_cast<int64_t>(t.merge_list_.size()), merges_wanted);
  }
  t.specials_[kEndOfText] = static_cast<int32_t>(t.tokens_.size());
  t.tokens_.push_back(kEndOfText);
  t.index_tokens();
  return t;
}

void BpeTokenizer::save(const std::string& path) const {
  std::ostringstream out;
  out << kFormat << "\n";
  for (int b = 0; b < 256; ++b) out << (b ? " " : "bytes ") << byte_ids_[b];
  out << "\n";
  for (const auto& [name, id] : specials_) out << "special " << id << " " << name << "\n";
  out << "merges " << merge_list_.size() << "\n";
  for (const auto& [left, right] : merge_list_) {
    out << left << " " << right << " " << merges_.at(pair_key(left, right)).result << "\n";
  }
  write_file_atomic(path, out.str());
}

BpeTokenizer BpeTokenizer::load(const std::string& path) {
  std::istringstream in(read_file(path));
  std::string line;
  int64_t line_number = 0;
  auto next_line = [&](const char* what) {
    if (!std::getline(in, line)) fail("{}:{}: file ends where {} was expected", path, line_number + 1, what);
    ++line_number;
    return line;
  };
  if (next_line("the format line") != kFormat) {
    fail("{}:1: not an mhla tokenizer file (expected '{}')", path, kFormat);
  }
  BpeTokenizer t;
  {
    std::istringstream bytes(next_line("the byte table"));
    std::string word;
    bytes >> word;
    if (word != "bytes") fail("{}:{}: expected 'bytes' and 256 ids", path, line_number);
    for (int b = 0; b < 256; ++b) {
      if (!(bytes >> t.byte_ids_[b]) || t.byte_ids_[b] < 0) fail("{}:{}: byte table needs 256 ids", path, line_number);
    }
  }
  std::vector<std::pair<int32_t, std::string>> specials;
  int64_t merge_count = -1;
  while (merge_count < 0) {
    std::istringstream fields(next_line("'merges N'"));
    std::string word;
    fields >> word;
    if (word == "special") {
      int32_t id;
      std::string name;
      if (!(fields >> id >> name)) fail("{}:{}: expected 'special ID NAME'", path, line_number);
      specials.push_back({id, name});
    } else if (word == "merges") {
      if (!(fields >> merge_count) || merge_count < 0) fail("{}:{}: expected 'merges N'", path, line_number);
    } else {
      fail("{}:{}: unexpected '{}'", path, line_number, word);
    }
  }
  // Ids: bytes first (as the byte table says), then merge results, then specials.
  int32_t max_id = 0;
  for (int b = 0; b < 256; ++b) max_id = std::max(max_id, t.byte_ids_[b]);
  std::vector<std::tuple<int32_t, int32_t, int32_t>> merges;
  for (int64_t m = 0; m < merge_count; ++m) {
    std::istringstream fields(next_line("a merge"));
    int32_t left, right, result;
    if (!(fields >> left >> right >> result)) fail("{}:{}: expected 'LEFT RIGHT RESULT'", path, line_number);
    merges.emplace_back(left, right, result);
    max_id = std::max(max_id, result);
  }
  for (auto& [id, name] : specials) max_id = std::max(max_id, id);
  t.tokens_.assign(max_id + 1, std::string());
  std::vector<bool> defined(max_id + 1, false);
  for (int b = 0; b < 256; ++b) {
    t.tokens_[t.byte_ids_[b]] = std::string(1, static_cast<char>(b));
    defined[t.byte_ids_[b]] = true;
  }
  int32_t rank = 0;
  for (auto& [left, right, result] : merges) {
    if (left < 0 || right < 0 || left > max_id || right > max_id || !defined[left] || !defined[right]) {
      fail("{}: merge {} uses an id not defined before it", path, rank + 1);
    }
    if (defined[result]) fail("{}: merge {} redefines id {}", path, rank + 1, result);
    t.tokens_[result] = t.tokens_[left] + t.tokens_[right];
    defined[result] = true;
    t.merges_[pair_key(left, right)] = {rank++, result};
    t.merge_list_.push_back({left, right});
  }
  for (auto& [id, name] : specials) {
    if (id < 0 || defined[id]) fail("{}: special '{}' has a taken id {}", path, name, id);
    t.tokens_[id] = name;
    defined[id] = true;
    t.specials_[name] = id;
  }
  for (int32_t id = 0; id <= max_id; ++id) {
    if (!defined[id]) fail("{}: id {} is never defined", path, id);
  }
  t.index_tokens();
  return t;
}

BpeTokenizer BpeTokenizer::load_gpt2(const std::string& folder) {
  const std::string encoder_path = folder + "/encoder.json", merges_path = folder + "/vocab.bpe";
  nlohmann::json encoder;
  try {
    encoder = nlohmann::json::parse(read_file(encoder_path));
  } catch (const nlohmann::json::parse_error& e) {
    fail("{}: byte offset {}: malformed JSON ({})", encoder_path, e.byte, e.what());
  }
  // Token strings are in GPT-2's printable byte encoding; map them back to bytes.
  const auto byte_to_cp = gpt2_byte_to_codepoint();
  std::unordered_map<std::string, unsigned char> symbol_to_byte;
  for (int b = 0; b < 256; ++b) symbol_to_byte[utf8(byte_to_cp[b])] = static_cast<unsigned char>(b);
  auto to_bytes = [&](const std::string& token) -> std::optional<std::string> {
    std::string bytes;
    for (size_t i = 0; i < token.size();) {
      size_t length = 1;
      const auto lead = static_cast<unsigned char>(token[i]);
      if (lead >= 0xC0) length = lead < 0xE0 ? 2 : (lead < 0xF0 ? 3 : 4);
      auto it = symbol_to_byte.find(token.substr(i, length));
      if (it == symbol_to_byte.end()) return std::nullopt;
      bytes += static_cast<char>(it->second);
      i += length;
    }
    return bytes;
  };
  BpeTokenizer t;
  t.tokens_.assign(encoder.size(), std::string());
  std::unordered_map<std::string, int32_t> id_of;
  for (const auto& [token, value] : encoder.items()) {
    const int32_t id = value.get<int32_t>();
    if (id < 0 || id >= static_cast<int32_t>(encoder.size())) fail("{}: id {} out of range", encoder_path, id);
    id_of[token] = id;
    if (token == kEndOfText) {
      t.tokens_[id] = token;
      t.specials_[token] = id;
      continue;
    }
    auto bytes = to_bytes(token);
    if (!bytes) fail("{}: token '{}' is not in GPT-2's byte encoding", encoder_path, token);
    t.tokens_[id] = *bytes;
    if (bytes->size() == 1) t.byte_ids_[static_cast<unsigned char>((*bytes)[0])] = id;
  }
  std::istringstream in(read_file(merges_path));
  std::string line;
  int64_t line_number = 0;
  int32_t rank = 0;
  while (std::getline(in, line)) {
    ++line_number;
    if (line.empty() || line.rfind("#version", 0) == 0) continue;
    const auto space = line.find(' ');
    if (space == std::string::npos) fail("{}:{}: expected two tokens", merges_path, line_number);
    const std::string left = line.substr(0, space), right = line.substr(space + 1);
    auto l = id_of.find(left), r = id_of.find(right), m = id_of.find(left + right);
    if (l == id_of.end() || r == id_of.end() || m == id_of.end()) {
      fail("{}:{}: merge '{}' uses tokens missing from encoder.json", merges_path, line_number, line);
    }
    t.merges_[pair_key(l->second, r->second)] = {rank++, m->second};
    t.merge_list_.push_back({l->second, r->second});
  }
  t.index_tokens();
  return t;
}

}  // namespace mhla
