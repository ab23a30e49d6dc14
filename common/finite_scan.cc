#include "common/finite_scan.h"

#include <cmath>
#include <cstdint>
#include <cstring>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace zeroshard {
namespace {

constexpr uint32_t kExponentBits = 0x7f800000u;
constexpr char kPayload[] = "zeroshard.dev/nonfinite-tensor";
// Values per block of the fast pass: 16 KiB, cache-resident for the search
// that follows a hit.
constexpr int64_t kBlock = 4096;

bool BlockHasNonFinite(const char* bytes, int64_t count) {
  uint32_t any = 0;
  for (int64_t i = 0; i < count; ++i) {
    uint32_t bits;
    std::memcpy(&bits, bytes + i * 4, 4);
    any |= static_cast<uint32_t>((bits & kExponentBits) == kExponentBits);
  }
  return any != 0;
}

}  // namespace

int64_t FirstNonFiniteF32(const void* values, int64_t count) {
  const char* bytes = static_cast<const char*>(values);
  for (int64_t begin = 0; begin < count; begin += kBlock) {
    const int64_t n = count - begin < kBlock ? count - begin : kBlock;
    if (!BlockHasNonFinite(bytes + begin * 4, n)) continue;
    for (int64_t i = 0; i < n; ++i) {
      uint32_t bits;
      std::memcpy(&bits, bytes + (begin + i) * 4, 4);
      if ((bits & kExponentBits) == kExponentBits) return begin + i;
    }
  }
  return -1;
}

absl::Status NonFiniteTensorError(absl::string_view what, absl::string_view tensor, int64_t index,
                                  float value) {
  // NaN's sign bit means nothing to a reader: "nan", never "-nan".
  const char* shown = std::isnan(value) ? "nan" : value > 0 ? "inf" : "-inf";
  absl::Status status = absl::FailedPreconditionError(absl::StrFormat(
      "%s: tensor %s holds %s at element %d: not saved (a checkpoint or snapshot keeps finite "
      "values only; the parameters or optimizer state overflowed after a step whose loss and "
      "gradient norm were finite, or memory was corrupted: docs/numerics.md)",
      what, tensor, shown, index));
  status.SetPayload(kPayload, absl::Cord("1"));
  return status;
}

bool IsNonFiniteTensorError(const absl::Status& status) {
  return status.GetPayload(kPayload).has_value();
}

}  // namespace zeroshard
