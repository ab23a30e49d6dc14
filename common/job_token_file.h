// The job token file format: <dir>/<job>.token holds one random token
// (64 hex digits and a newline), mode 0600. The server reads the directory
// (shard_server/auth/job_credentials.h); `shardctl job create` writes a file.
// Here, not in shard_server/, because both sides use it and the client
// must not depend on the server.
#ifndef ZEROSHARD_COMMON_JOB_TOKEN_FILE_H_
#define ZEROSHARD_COMMON_JOB_TOKEN_FILE_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace zeroshard {

inline constexpr char kJobTokenSuffix[] = ".token";

// <dir>/<job>.token.
std::string JobTokenPath(absl::string_view dir, absl::string_view job);

// The job a file named `name` ("<job>.token") holds the token of; empty
// when the name is not a token file's or the job id is not valid.
std::string JobOfTokenFileName(absl::string_view name);

// A new random job token (64 hex digits from /dev/urandom) written to
// <dir>/<job>.token with mode 0600; ALREADY_EXISTS when the job has one
// (remove the file to revoke it). INVALID_ARGUMENT for a bad job id.
absl::StatusOr<std::string> CreateJobTokenFile(const std::string& dir, const std::string& job);

}  // namespace zeroshard

#endif  // ZEROSHARD_COMMON_JOB_TOKEN_FILE_H_
