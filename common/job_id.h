// The one rule for job ids, which every RPC that names a job applies: a job
// id becomes a directory name under the checkpoint root, so it is one
// portable, path-safe name. And the rule for worker ids.
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

// Worker ids: 1..kMaxWorkerIdLength bytes, no control character (the server
// prints and logs them). The server's rule; the worker applies it to
// --worker_id before it joins.
inline constexpr size_t kMaxWorkerIdLength = 256;
absl::Status ValidateWorkerId(absl::string_view worker_id);

}  // namespace zeroshard

#endif  // ZEROSHARD_COMMON_JOB_ID_H_
