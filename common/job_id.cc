#include "common/job_id.h"

#include <string>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

namespace zeroshard {

absl::Status ValidateJobId(absl::string_view job_id) {
  if (job_id.empty()) return absl::InvalidArgumentError("job_id is empty");
  if (job_id.size() > kMaxJobIdLength) {
    return absl::InvalidArgumentError(
        absl::StrCat("job_id is ", job_id.size(), " characters long; at most ", kMaxJobIdLength));
  }
  if (job_id[0] == '.' || job_id[0] == '-') {
    return absl::InvalidArgumentError(
        absl::StrCat("job_id '", job_id, "' must not start with '.' or '-'"));
  }
  for (char c : job_id) {
    bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
              c == '-' || c == '_' || c == '.';
    if (!ok) {
      return absl::InvalidArgumentError(
          absl::StrCat("job_id '", job_id, "' has character '", std::string(1, c),
                       "'; expected letters, digits, '-', '_' or '.'"));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateWorkerId(absl::string_view worker_id) {
  if (worker_id.empty()) return absl::InvalidArgumentError("worker_id is empty");
  if (worker_id.size() > kMaxWorkerIdLength) {
    return absl::InvalidArgumentError(absl::StrCat(
        "worker_id is ", worker_id.size(), " characters long; at most ", kMaxWorkerIdLength));
  }
  for (unsigned char c : worker_id) {
    if (c < 0x20 || c == 0x7f) {
      return absl::InvalidArgumentError(
          absl::StrCat("worker_id '", absl::CEscape(worker_id), "' has a control character"));
    }
  }
  return absl::OkStatus();
}

}  // namespace zeroshard
