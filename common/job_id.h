// The one rule for job ids, which every RPC that names a job applies: a job
// id becomes a directory name under the checkpoint root, so it is one
// portable, path-safe name.
#ifndef ZEROSHARD_COMMON_JOB_ID_H_
#define ZEROSHARD_COMMON_JOB_ID_H_

#include <cstddef>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace zeroshard {

inline constexpr size_t kMaxJobIdLength = 128;

// OK for 1..kMaxJobIdLength letters, digits, '-', '_' and '.', not starting
// with '.' or '-'. INVALID_ARGUMENT naming the value and the rule otherwise.
absl::Status ValidateJobId(absl::string_view job_id);

}  // namespace zeroshard

#endif  // ZEROSHARD_COMMON_JOB_ID_H_
