#include "shard_server/auth/job_credentials.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "common/file_util.h"
#include "common/job_id.h"
#include "common/secret_file.h"

namespace zeroshard {
namespace {

constexpr char kBearer[] = "Bearer ";

// The token after "Bearer ", or empty.
absl::string_view PresentedToken(const ClientMetadata& metadata) {
  auto it = metadata.find("authorization");
  if (it == metadata.end()) return {};
  absl::string_view value(it->second.data(), it->second.size());
  if (!absl::ConsumePrefix(&value, kBearer)) return {};
  return value;
}

// Equality in time that depends only on the lengths.
bool SameSecret(absl::string_view a, absl::string_view b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  }
  return diff == 0;
}

}  // namespace

grpc::Status Caller::MayActOn(absl::string_view target) const {
  if (admin || target == job) return grpc::Status::OK;
  return grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                      absl::StrCat("this token is job '", job, "''s; it cannot act on job '",
                                   target, "' (the admin token can)"));
}

JobCredentials::JobCredentials(std::string admin_token, std::string job_tokens_dir, bool insecure)
    : admin_token_(std::move(admin_token)), dir_(std::move(job_tokens_dir)), insecure_(insecure) {}

absl::StatusOr<Caller> JobCredentials::Identify(const ClientMetadata& metadata) {
  if (admin_token_.empty()) return Caller{/*admin=*/true, ""};
  if (grpc::Status admin = CheckBearerToken(metadata, admin_token_); admin.ok()) {
    return Caller{/*admin=*/true, ""};
  } else if (dir_.empty()) {
    return absl::UnauthenticatedError(admin.error_message());
  }
  const absl::string_view presented = PresentedToken(metadata);
  if (!presented.empty()) {
    absl::MutexLock lock(&mu_);
    ReloadIfChanged();
    auto it = job_of_token_.find(presented);
    if (it != job_of_token_.end() && SameSecret(it->first, presented)) {
      return Caller{/*admin=*/false, it->second};
    }
  }
  return absl::UnauthenticatedError(
      presented.empty()
          ? "missing 'authorization: Bearer <token>' metadata; this server requires the admin "
            "token or a job token (pass it with --token_file)"
          : "wrong bearer token: neither the admin token nor a job token (shardctl job create "
            "issues one)");
}

grpc::Status JobCredentials::Authorize(const ClientMetadata& metadata, absl::string_view job) {
  absl::StatusOr<Caller> caller = Identify(metadata);
  if (!caller.ok()) {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, std::string(caller.status().message()));
  }
  return caller->MayActOn(job);
}

size_t JobCredentials::job_tokens() {
  absl::MutexLock lock(&mu_);
  ReloadIfChanged();
  return job_of_token_.size();
}

void JobCredentials::ReloadIfChanged() {
  struct stat st;
  if (dir_.empty() || stat(dir_.c_str(), &st) != 0) {
    job_of_token_.clear();
    dir_mtime_ = {-1, 0};
    return;
  }
  if (st.st_mtim.tv_sec == dir_mtime_.tv_sec && st.st_mtim.tv_nsec == dir_mtime_.tv_nsec) return;
  dir_mtime_ = st.st_mtim;
  job_of_token_.clear();
  DIR* dir = opendir(dir_.c_str());
  if (dir == nullptr) return;
  while (dirent* entry = readdir(dir)) {
    const std::string name = JobOfTokenFileName(entry->d_name);
    if (name.empty()) continue;
    const std::string path = absl::StrCat(dir_, "/", entry->d_name);
    absl::StatusOr<std::string> token = ReadTokenFile(path, "job token file", insecure_);
    if (!token.ok()) {
      std::fprintf(stderr, "shard_server: job token %s left out: %s\n", path.c_str(),
                   std::string(token.status().message()).c_str());
      continue;
    }
    if (SameSecret(*token, admin_token_)) continue;  // never a job's: it is the admin's
    job_of_token_[*token] = name;
  }
  closedir(dir);
}

}  // namespace zeroshard
