#include "common/job_token_file.h"

#include <fcntl.h>
#include <unistd.h>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "common/file_util.h"
#include "common/job_id.h"

namespace zeroshard {

std::string JobTokenPath(absl::string_view dir, absl::string_view job) {
  return absl::StrCat(dir, "/", job, kJobTokenSuffix);
}

std::string JobOfTokenFileName(absl::string_view name) {
  if (!absl::ConsumeSuffix(&name, kJobTokenSuffix) || !ValidateJobId(name).ok()) return "";
  return std::string(name);
}

absl::StatusOr<std::string> CreateJobTokenFile(const std::string& dir, const std::string& job) {
  if (absl::Status s = ValidateJobId(job); !s.ok()) return s;
  unsigned char random[32];
  const int urandom = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
  if (urandom < 0) return ErrnoStatus(errno, "cannot open", "/dev/urandom");
  const ssize_t got = read(urandom, random, sizeof(random));
  close(urandom);
  if (got != static_cast<ssize_t>(sizeof(random))) {
    return absl::InternalError("short read from /dev/urandom");
  }
  const std::string token =
      absl::BytesToHexString(absl::string_view(reinterpret_cast<char*>(random), sizeof(random)));
  const std::string path = JobTokenPath(dir, job);
  const std::string temp = absl::StrCat(path, ".tmp-", getpid());
  const int fd = open(temp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) return ErrnoStatus(errno, "cannot create", temp);
  const std::string line = token + "\n";
  const bool written =
      write(fd, line.data(), line.size()) == static_cast<ssize_t>(line.size()) && fsync(fd) == 0;
  close(fd);
  // link() fails when the job has a token already: never replaced silently.
  if (!written || link(temp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    unlink(temp.c_str());
    if (err == EEXIST) {
      return absl::AlreadyExistsError(absl::StrCat("job '", job, "' has a token already (", path,
                                                   "); remove the file to revoke it"));
    }
    return ErrnoStatus(err, "cannot write", path);
  }
  unlink(temp.c_str());
  return token;
}

}  // namespace zeroshard
