#pragma once
// Small, platform-stable random numbers for data order and augmentation. Each sample's stream is
// derived from (seed, epoch, sample index), so results do not depend on how many loader threads
// run or in which order they finish, and a resumed run sees the same augmentations.
#include <cstdint>

namespace mhla {

inline uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

class StreamRng {
 public:
  explicit StreamRng(uint64_t seed) : state_(seed) {}
  StreamRng(uint64_t seed, uint64_t a, uint64_t b)
      : state_(splitmix64(splitmix64(splitmix64(seed) ^ a) ^ b)) {}
  uint64_t next() { return state_ = splitmix64(state_), state_; }
  // Uniform integer in [0, n) (Lemire's multiply-shift; n > 0).
  uint64_t below(uint64_t n) {
    return static_cast<uint64_t>((static_cast<unsigned __int128>(next()) * n) >> 64);
  }

 private:
  uint64_t state_;
};

}  // namespace mhla
