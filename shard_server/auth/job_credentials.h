// Who may act on which job: the admin token (--auth_token_file) acts on every
// job; a job token acts on its own job only. Job tokens are files
// <dir>/<job>.token (--job_tokens_dir; `shardctl job create` writes one),
// read again whenever the directory changes, so a job is added or revoked
// without restarting the server.
//
// With a job token a caller may join its job, beat, use the job's KV store,
// commit, upload, list and consolidate its checkpoints, read its status and
// history, and plan (a one-off plan touches no job). Any other job is
// PERMISSION_DENIED, and GetStatus shows only the caller's job. The metrics
// port and gRPC reflection stay admin-only.
#ifndef ZEROSHARD_SHARD_SERVER_AUTH_JOB_CREDENTIALS_H_
#define ZEROSHARD_SHARD_SERVER_AUTH_JOB_CREDENTIALS_H_

#include <ctime>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/grpcpp.h"
#include "common/job_token_file.h"
#include "shard_server/auth/bearer_auth.h"

namespace zeroshard {

// The identity a call's bearer token proves.
struct Caller {
  bool admin = false;  // the admin token, or a server without authentication
  std::string job;     // a job token's job (when not admin)

  // OK when this caller may act on `job`; PERMISSION_DENIED naming both jobs.
  grpc::Status MayActOn(absl::string_view job) const;
};

class JobCredentials {
 public:
  // `admin_token` empty: no authentication (every caller is admin; job
  // tokens are then pointless and `job_tokens_dir` must be empty).
  // `insecure`: accept world-readable or short job token files.
  JobCredentials(std::string admin_token, std::string job_tokens_dir, bool insecure);

  // The caller the metadata's "authorization: Bearer <token>" proves;
  // UNAUTHENTICATED when it carries neither the admin token nor a job's.
  // Thread-safe.
  absl::StatusOr<Caller> Identify(const ClientMetadata& metadata);
  // Identify + MayActOn as one gRPC status.
  grpc::Status Authorize(const ClientMetadata& metadata, absl::string_view job);

  // Job tokens read now (for tests and the log).
  size_t job_tokens();

  const std::string& admin_token() const { return admin_token_; }

 private:
  // Re-reads the directory when its modification time changed since the last
  // read. Files that are not "<valid job id>.token", or that ReadTokenFile
  // refuses, are left out (and logged once per change).
  void ReloadIfChanged() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::string admin_token_;
  const std::string dir_;
  const bool insecure_;
  absl::Mutex mu_;
  timespec dir_mtime_ ABSL_GUARDED_BY(mu_) = {-1, 0};
  absl::flat_hash_map<std::string, std::string> job_of_token_ ABSL_GUARDED_BY(mu_);
};

}  // namespace zeroshard

#endif  // ZEROSHARD_SHARD_SERVER_AUTH_JOB_CREDENTIALS_H_
