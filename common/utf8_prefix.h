// Cutting text to a byte budget without splitting a UTF-8 character: a
// proto3 string field must hold valid UTF-8, and a reader refuses a message
// whose string was cut inside a character.
#ifndef ZEROSHARD_COMMON_UTF8_PREFIX_H_
#define ZEROSHARD_COMMON_UTF8_PREFIX_H_

#include <cstddef>

#include "absl/strings/string_view.h"

namespace zeroshard {

// The longest prefix of `text` of at most `max_bytes` bytes that does not end
// inside a UTF-8 character (it stops before a continuation byte).
inline absl::string_view Utf8Prefix(absl::string_view text, size_t max_bytes) {
  if (text.size() <= max_bytes) return text;
  size_t cut = max_bytes;
  while (cut > 0 && (static_cast<unsigned char>(text[cut]) & 0xC0) == 0x80) --cut;
  return text.substr(0, cut);
}

}  // namespace zeroshard

#endif  // ZEROSHARD_COMMON_UTF8_PREFIX_H_
