#include "data/idx_file.h"

#include <filesystem>

#include <zlib.h>

#include "core/error.h"

namespace mhla {
namespace {

class GzReader {
 public:
  explicit GzReader(const std::string& path) : path_(path) {
    if (!std::filesystem::exists(path)) fail("{}: file not found", path);
    file_ = gzopen(path.c_str(), "rb");
    if (!file_) fail("{}: cannot open", path);
    gzbuffer(file_, 1 << 20);
  }
  ~GzReader() {
    if (file_) gzclose(file_);
  }
  // Reads up to n bytes; returns how many arrived (fewer only at the end of the stream).
  size_t read(uint8_t* out, size_t n) {
    size_t total = 0;
    while (total < n) {
      const unsigned chunk = static_cast<unsigned>(std::min<size_t>(n - total, 1u << 30));
      int got = gzread(file_, out + total, chunk);
      if (got < 0) {
        int code = 0;
        const char* message = gzerror(file_, &code);
        fail("{}: byte offset {}: corrupt or unreadable data ({})", path_, offset_ + total,
             message ? message : "zlib error");
      }
      if (got == 0) break;
      total += static_cast<size_t>(got);
    }
    offset_ += total;
    return total;
  }
  uint64_t offset() const { return offset_; }

 private:
  std::string path_;
  gzFile file_ = nullptr;
  uint64_t offset_ = 0;
};

}  // namespace

IdxArray read_idx_file(const std::string& path, int expected_dims) {
  GzReader reader(path);
  uint8_t magic[4];
  if (reader.read(magic, 4) != 4) fail("{}: byte offset 0: file too short for an IDX header", path);
  if (magic[0] != 0 || magic[1] != 0) {
    fail("{}: byte offset 0: bad magic {:02x}{:02x}{:02x}{:02x} (an IDX file starts with two zero "
         "bytes)", path, magic[0], magic[1], magic[2], magic[3]);
  }
  if (magic[2] != 0x08) {
    fail("{}: byte offset 2: element type 0x{:02x} is not supported (expected 0x08, unsigned "
         "byte)", path, magic[2]);
  }
  if (magic[3] != expected_dims) {
    fail("{}: byte offset 3: {} dimensions, expected {}", path, magic[3], expected_dims);
  }
  IdxArray array;
  uint64_t elements = 1;
  for (int i = 0; i < expected_dims; ++i) {
    uint8_t be[4];
    const uint64_t at = reader.offset();
    if (reader.read(be, 4) != 4) {
      fail("{}: byte offset {}: file ends inside the header (dimension {} of {})", path, at,
           i + 1, expected_dims);
    }
    const int64_t dim = (int64_t{be[0]} << 24) | (be[1] << 16) | (be[2] << 8) | be[3];
    if (dim <= 0) fail("{}: byte offset {}: dimension {} is {}", path, at, i + 1, dim);
    array.dims.push_back(dim);
    elements *= static_cast<uint64_t>(dim);
    if (elements > (1ull << 36)) fail("{}: byte offset {}: implausible size", path, at);
  }
  const uint64_t header = reader.offset();
  array.data.resize(elements);
  const size_t got = reader.read(array.data.data(), elements);
  if (got != elements) {
    fail("{}: byte offset {}: file truncated: the header announces {} data bytes after byte {}, "
         "only {} are present", path, header + got, elements, header, got);
  }
  uint8_t extra;
  if (reader.read(&extra, 1) != 0) {
    fail("{}: byte offset {}: unexpected bytes after the {} announced data bytes", path,
         header + elements, elements);
  }
  return array;
}

}  // namespace mhla
