// Checksums of checkpoint bytes: XXH64 with seed 0 (libxxhash), the 64-bit
// xxHash that `xxhsum -H64` and python's xxhash.xxh64() compute.
#ifndef ZEROSHARD_COMMON_CHECKSUM_H_
#define ZEROSHARD_COMMON_CHECKSUM_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

struct XXH64_state_s;

namespace zeroshard {

// XXH64(seed 0) of `size` bytes at `data`.
uint64_t Checksum(const void* data, size_t size);
inline uint64_t Checksum(absl::string_view bytes) { return Checksum(bytes.data(), bytes.size()); }

// Streaming form: Update() over consecutive pieces gives the same digest as
// Checksum() over their concatenation. Digest() does not end the stream.
class Hasher {
 public:
  Hasher();
  ~Hasher();
  Hasher(Hasher&& other) noexcept;
  Hasher& operator=(Hasher&& other) noexcept;
  Hasher(const Hasher&) = delete;
  Hasher& operator=(const Hasher&) = delete;

  void Update(const void* data, size_t size);
  void Update(absl::string_view bytes) { Update(bytes.data(), bytes.size()); }
  uint64_t Digest() const;
  void Reset();

 private:
  XXH64_state_s* state_;  // owned; null only after being moved from
};

// 16 lowercase hex digits, most significant first ("ef46db3751d8e999").
std::string ChecksumToHex(uint64_t checksum);

// Inverse of ChecksumToHex (either case accepted). INVALID_ARGUMENT unless
// exactly 16 hex digits.
absl::StatusOr<uint64_t> ParseChecksumHex(absl::string_view hex);

}  // namespace zeroshard

#endif  // ZEROSHARD_COMMON_CHECKSUM_H_
