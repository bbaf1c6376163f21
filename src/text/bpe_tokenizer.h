#pragma once
// Byte-level BPE: text -> GPT-2 pre-tokenizer pieces -> bytes -> merges by rank -> ids. Every
// byte sequence encodes and decodes back exactly. Two sources: our own trained tokenizers
// (`mhla tokenizer train`, saved as a small text file) and GPT-2's released files.
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace mhla {

class BpeTokenizer {
 public:
  // Learns merges from `texts` until the vocabulary (256 bytes + merges + the special
  // <|endoftext|>) has `vocab_size` entries. Deterministic: ties go to the smaller pair of ids.
  static BpeTokenizer train(const std::vector<std::string>& texts, int64_t vocab_size,
                            const std::function<void(int64_t merges, int64_t total)>& progress = {});
  static BpeTokenizer load(const std::string& path);
  // encoder.json + vocab.bpe as OpenAI released them.
  static BpeTokenizer load_gpt2(const std::string& folder);
  // Our format, written atomically.
  void save(const std::string& path) const;

  std::vector<int32_t> encode(std::string_view text) const;
  std::string decode(const std::vector<int32_t>& ids) const;
  int64_t vocab_size() const { return static_cast<int64_t>(tokens_.size()); }
  std::optional<int32_t> special(const std::string& name) const;
  const std::string& token_bytes(int32_t id) const { return tokens_.at(id); }

 private:
  struct Merge {
    int32_t rank, result;
  };
  static uint64_t pair_key(int32_t a, int32_t b) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
  }
  void encode_piece(std::string_view piece, std::vector<int32_t>& out) const;
  void index_tokens();

  std::vector<std::string> tokens_;                  // id -> bytes
  std::vector<int32_t> byte_ids_ = std::vector<int32_t>(256, -1);
  std::unordered_map<uint64_t, Merge> merges_;       // (left, right) -> rank, result
  std::vector<std::pair<int32_t, int32_t>> merge_list_;  // in rank order (for saving)
  std::map<std::string, int32_t> specials_;
  mutable std::unordered_map<std::string, std::vector<int32_t>> cache_;
};

}  // namespace mhla
