#pragma once
// Reader for the IDX format (MNIST / Fashion-MNIST), gzip-compressed or raw:
// bytes 0-1 zero, byte 2 the element type (0x08 = uint8), byte 3 the number of dimensions,
// then one big-endian uint32 per dimension, then the elements. Every inconsistency is an error
// naming the file and the byte offset (in the decompressed stream for .gz files).
#include <cstdint>
#include <string>
#include <vector>

namespace mhla {

struct IdxArray {
  std::vector<int64_t> dims;
  std::vector<uint8_t> data;
};

IdxArray read_idx_file(const std::string& path, int expected_dims);

}  // namespace mhla
