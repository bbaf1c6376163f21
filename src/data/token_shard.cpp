#include "data/token_shard.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "core/atomic_file.h"
#include "core/error.h"

namespace mhla {
namespace {

constexpr char kMagic[8] = {'M', 'H', 'L', 'A', 'T', 'O', 'K', '1'};
constexpr uint32_t kVersion = 1;
constexpr size_t kHeader = 32;

template <typename T>
void put(std::string& out, size_t at, T value) {
  for (size_t i = 0; i < sizeof(T); ++i) out[at + i] = static_cast<char>((value >> (8 * i)) & 0xFF);
}

template <typename T>
T get(const uint8_t* data, size_t at) {
  T value = 0;
  for (size_t i = 0; i < sizeof(T); ++i) value |= static_cast<T>(data[at + i]) << (8 * i);
  return value;
}

}  // namespace

void write_token_shard(const std::string& path, const std::vector<int32_t>& tokens,
                       int64_t vocab_size) {
  if (vocab_size <= 0 || vocab_size > 65536) {
    fail("{}: vocabulary size {} does not fit uint16 tokens", path, vocab_size);
  }
  std::string out(kHeader + 2 * tokens.size(), '\0');
  std::memcpy(out.data(), kMagic, 8);
  put<uint32_t>(out, 8, kVersion);
  put<uint32_t>(out, 12, static_cast<uint32_t>(vocab_size));
  put<uint64_t>(out, 16, tokens.size());
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] < 0 || tokens[i] >= vocab_size) {
      fail("{}: token {} at position {} is outside the vocabulary of {}", path, tokens[i], i, vocab_size);
    }
    put<uint16_t>(out, kHeader + 2 * i, static_cast<uint16_t>(tokens[i]));
  }
  write_file_atomic(path, out);
}

TokenShard::TokenShard(const std::string& path) : path_(path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail("{}: cannot open ({})", path, std::strerror(errno));
  struct stat info {};
  ::fstat(fd, &info);
  map_size_ = static_cast<size_t>(info.st_size);
  if (map_size_ < kHeader) {
    ::close(fd);
    fail("{}: byte offset 0: {} bytes, too short for the 32-byte token-shard header", path, map_size_);
  }
  map_ = ::mmap(nullptr, map_size_, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  if (map_ == MAP_FAILED) {
    map_ = nullptr;
    fail("{}: cannot map ({})", path, std::strerror(errno));
  }
  const auto* data = static_cast<const uint8_t*>(map_);
  auto reject = [&](const std::string& message) {
    ::munmap(map_, map_size_);
    map_ = nullptr;
    throw Error(message);
  };
  if (std::memcmp(data, kMagic, 8) != 0) {
    reject(fmt::format("{}: byte offset 0: bad magic (not an mhla token shard)", path));
  }
  const uint32_t version = get<uint32_t>(data, 8);
  if (version != kVersion) {
    reject(fmt::format("{}: byte offset 8: format version {} is not supported (expected {})",
                       path, version, kVersion));
  }
  vocab_size_ = get<uint32_t>(data, 12);
  if (vocab_size_ == 0 || vocab_size_ > 65536) {
    reject(fmt::format("{}: byte offset 12: vocabulary size {} is invalid", path, vocab_size_));
  }
  const uint64_t count = get<uint64_t>(data, 16);
  const uint64_t expected = kHeader + 2 * count;
  if (count > (uint64_t{1} << 40) || expected != map_size_) {
    reject(fmt::format("{}: byte offset {}: the header announces {} tokens ({} bytes), the file "
                       "has {} bytes{}", path, std::min<uint64_t>(expected, map_size_), count,
                       expected, map_size_, expected > map_size_ ? " (truncated)" : " (trailing bytes)"));
  }
  count_ = static_cast<int64_t>(count);
  tokens_ = reinterpret_cast<const uint16_t*>(data + kHeader);
}

TokenShard::~TokenShard() {
  if (map_) ::munmap(map_, map_size_);
}

}  // namespace mhla
