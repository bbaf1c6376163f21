#pragma once
// Token shards: a 32-byte header, then uint16 tokens (little-endian), memory-mapped for reading.
//   bytes 0-7   magic "MHLATOK1"
//   bytes 8-11  format version (1), uint32
//   bytes 12-15 vocabulary size, uint32 (every token is below it)
//   bytes 16-23 token count, uint64
//   bytes 24-31 zero
// A bad magic, version or a length that disagrees with the count is an error naming the file
// and the byte offset.
#include <cstdint>
#include <string>
#include <vector>

namespace mhla {

void write_token_shard(const std::string& path, const std::vector<int32_t>& tokens,
                       int64_t vocab_size);

class TokenShard {
 public:
  explicit TokenShard(const std::string& path);
  ~TokenShard();
  TokenShard(const TokenShard&) = delete;
  TokenShard& operator=(const TokenShard&) = delete;

  int64_t size() const { return count_; }
  int64_t vocab_size() const { return vocab_size_; }
  const uint16_t* tokens() const { return tokens_; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  void* map_ = nullptr;
  size_t map_size_ = 0;
  const uint16_t* tokens_ = nullptr;
  int64_t count_ = 0, vocab_size_ = 0;
};

}  // namespace mhla
