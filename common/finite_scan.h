// Finding NaN and ±Inf in f32 bytes that a writer is already reading (for
// its checksum): checkpoints and snapshots refuse to keep them
// (docs/numerics.md, "Nothing non-finite is saved").
#ifndef ZEROSHARD_COMMON_FINITE_SCAN_H_
#define ZEROSHARD_COMMON_FINITE_SCAN_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace zeroshard {

// The index of the first of `count` f32 values at `values` that is NaN or
// ±Inf (all exponent bits set), or -1 when every one is finite. Reads the
// values as bits (no alignment needed, no floating-point exceptions); the
// common all-finite case is one branch-free pass that vectorizes.
int64_t FirstNonFiniteF32(const void* values, int64_t count);

// The refusal: FAILED_PRECONDITION "<what>: tensor <tensor> holds <value>
// at element <index>: not saved (...)", marked so that callers can tell it
// from other errors (IsNonFiniteTensorError).
absl::Status NonFiniteTensorError(absl::string_view what, absl::string_view tensor, int64_t index,
                                  float value);
bool IsNonFiniteTensorError(const absl::Status& status);

}  // namespace zeroshard

#endif  // ZEROSHARD_COMMON_FINITE_SCAN_H_
