#include "common/checksum.h"

#include <xxhash.h>

#include <cstdlib>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace zeroshard {
namespace {

constexpr XXH64_hash_t kSeed = 0;

XXH64_state_t* NewState() {
  XXH64_state_t* state = XXH64_createState();
  if (state == nullptr) std::abort();  // out of memory
  XXH64_reset(state, kSeed);
  return state;
}

}  // namespace

uint64_t Checksum(const void* data, size_t size) { return XXH64(data, size, kSeed); }

Hasher::Hasher() : state_(NewState()) {}

Hasher::~Hasher() {
  if (state_ != nullptr) XXH64_freeState(state_);
}

Hasher::Hasher(Hasher&& other) noexcept : state_(other.state_) { other.state_ = nullptr; }

Hasher& Hasher::operator=(Hasher&& other) noexcept {
  if (this != &other) {
    if (state_ != nullptr) XXH64_freeState(state_);
    state_ = other.state_;
    other.state_ = nullptr;
  }
  return *this;
}

void Hasher::Update(const void* data, size_t size) {
  if (state_ == nullptr) state_ = NewState();  // reuse after move
  // Only fails for a null state, which cannot happen here.
  XXH64_update(state_, data, size);
}

uint64_t Hasher::Digest() const {
  return state_ == nullptr ? XXH64(nullptr, 0, kSeed) : XXH64_digest(state_);
}

void Hasher::Reset() {
  if (state_ == nullptr) {
    state_ = NewState();
  } else {
    XXH64_reset(state_, kSeed);
  }
}

std::string ChecksumToHex(uint64_t checksum) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string hex(16, '0');
  for (int i = 15; i >= 0; --i) {
    hex[i] = kDigits[checksum & 0xf];
    checksum >>= 4;
  }
  return hex;
}

absl::StatusOr<uint64_t> ParseChecksumHex(absl::string_view hex) {
  if (hex.size() != 16) {
    return absl::InvalidArgumentError(absl::StrCat("checksum \"", hex, "\" has ", hex.size(),
                                                   " characters; expected 16 hex digits"));
  }
  uint64_t value = 0;
  for (char c : hex) {
    int digit;
    if (c >= '0' && c <= '9') {
      digit = c - '0';
    } else if (c >= 'a' && c <= 'f') {
      digit = c - 'a' + 10;
    } else if (c >= 'A' && c <= 'F') {
      digit = c - 'A' + 10;
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("checksum \"", hex, "\" is not 16 hex digits"));
    }
    value = (value << 4) | static_cast<uint64_t>(digit);
  }
  return value;
}

}  // namespace zeroshard
