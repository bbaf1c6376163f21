#pragma once
// SHA-256 (FIPS 180-4), for fingerprints of weight files written into results.
#include <cstdint>
#include <string>
#include <string_view>

namespace mhla {

std::string sha256_hex(std::string_view bytes);
// Streams the file; throws (naming the file) when it cannot be read.
std::string sha256_file(const std::string& path);

}  // namespace mhla
