// One way to say which step of a program failed, keeping the code:
// "<what>: <CODE>: <message>", the text shard_worker prints for a failure.
#ifndef ZEROSHARD_COMMON_STATUS_CONTEXT_H_
#define ZEROSHARD_COMMON_STATUS_CONTEXT_H_

#include <cassert>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace zeroshard {

// REQUIRES: !status.ok() (an OK status has no failure to name).
inline absl::Status Annotate(const absl::Status& status, absl::string_view what) {
  assert(!status.ok() && "Annotate of an OK status would return OK and drop `what`");
  return absl::Status(status.code(), absl::StrCat(what, ": ", status.ToString()));
}

}  // namespace zeroshard

#endif  // ZEROSHARD_COMMON_STATUS_CONTEXT_H_
