#include "shard_server/checkpoint/checkpoint_paths.h"

#include <dirent.h>
#include <errno.h>
#include <limits.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cassert>
#include <cstring>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/file_util.h"

namespace zeroshard {
namespace {

absl::StatusOr<std::string> RealPath(const std::string& path) {
  char* resolved = realpath(path.c_str(), nullptr);
  if (resolved == nullptr) return ErrnoStatus(errno, "cannot resolve", path);
  std::string out(resolved);
  free(resolved);
  return out;
}

// "<anything>.tmp-<16 lowercase hex digits>": AtomicFile's and
// DirectoryOutput's temporary names.
bool IsTemporaryName(absl::string_view name) {
  const size_t at = name.rfind(".tmp-");
  if (at == absl::string_view::npos || name.size() - at != 5 + 16) return false;
  for (char c : name.substr(at + 5)) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

// A directory itself, not a symlink to one.
bool IsDirectory(const std::string& path) {
  struct stat st;
  return lstat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

// Names of the entries of `dir`, without "." and ".." (empty if unreadable).
std::vector<std::string> Entries(const std::string& dir) {
  std::vector<std::string> names;
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return names;
  while (struct dirent* entry = readdir(d)) {
    std::string name = entry->d_name;
    if (name != "." && name != "..") names.push_back(std::move(name));
  }
  closedir(d);
  return names;
}

std::string Parent(const std::string& path) {
  size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

}  // namespace

absl::Status ValidateRelativePath(absl::string_view relative) {
  if (relative.empty()) return absl::InvalidArgumentError("file path is empty");
  if (relative[0] == '/') {
    return absl::InvalidArgumentError(absl::StrCat(
        "file '", relative, "' is an absolute path; expected a path relative to the checkpoint "
        "root, e.g. <job>/step-<N>/rank-<R>-of-<W>.safetensors"));
  }
  if (relative.find('\0') != absl::string_view::npos) {
    return absl::InvalidArgumentError("file path contains a NUL byte");
  }
  for (absl::string_view part : absl::StrSplit(relative, '/')) {
    if (part == "..") {
      return absl::InvalidArgumentError(
          absl::StrCat("file '", relative, "' contains '..'; paths must stay below the root"));
    }
    if (part.empty() || part == ".") {
      return absl::InvalidArgumentError(absl::StrCat(
          "file '", relative, "' has an empty or '.' component; expected a plain relative path"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<CheckpointRoot> CheckpointRoot::Open(const std::string& root) {
  if (root.empty()) return absl::InvalidArgumentError("checkpoint root is empty");
  std::string partial;
  for (absl::string_view part : absl::StrSplit(root, '/')) {
    partial += std::string(part);
    if (!part.empty() && mkdir(partial.c_str(), 0755) != 0 && errno != EEXIST) {
      return ErrnoStatus(errno, "cannot create checkpoint root directory", partial);
    }
    partial += "/";
  }
  absl::StatusOr<std::string> real = RealPath(root);
  if (!real.ok()) return real.status();
  struct stat st;
  if (stat(real->c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    return absl::FailedPreconditionError(
        absl::StrCat("checkpoint root ", root, " is not a directory"));
  }
  return CheckpointRoot(root, *std::move(real));
}

std::string CheckpointRoot::Join(absl::string_view relative) const {
  assert(ValidateRelativePath(relative).ok());
  return absl::StrCat(path_, "/", relative);
}

bool CheckpointRoot::IsBelowRoot(const std::string& real) const {
  if (real == real_path_) return true;
  if (real_path_ == "/") return true;
  return real.size() > real_path_.size() && real.compare(0, real_path_.size(), real_path_) == 0 &&
         real[real_path_.size()] == '/';
}

absl::Status CheckpointRoot::CheckResolvesInside(const std::string& full,
                                                 absl::string_view shown) const {
  absl::StatusOr<std::string> real = RealPath(full);
  if (!real.ok()) return real.status();
  if (!IsBelowRoot(*real)) {
    return absl::FailedPreconditionError(
        absl::StrCat("'", shown, "' resolves to ", *real, ", outside the checkpoint root ",
                     real_path_, " (a symlink leading out?); refused"));
  }
  return absl::OkStatus();
}

absl::Status CheckpointRoot::CheckInside(absl::string_view relative) const {
  if (absl::Status s = ValidateRelativePath(relative); !s.ok()) return s;
  const std::string full = Join(relative);
  struct stat st;
  if (lstat(full.c_str(), &st) != 0) {
    if (errno == ENOENT) {
      return absl::NotFoundError(absl::StrCat("file '", relative, "' does not exist under the "
                                              "checkpoint root ", path_));
    }
    return ErrnoStatus(errno, "cannot stat", full);
  }
  if (absl::Status s = CheckResolvesInside(Parent(full), Parent(std::string(relative)));
      !s.ok()) {
    return s;
  }
  return CheckResolvesInside(full, relative);
}

absl::Status CheckpointRoot::MakeDirs(absl::string_view relative) const {
  if (absl::Status s = ValidateRelativePath(relative); !s.ok()) return s;
  std::string shown;
  for (absl::string_view part : absl::StrSplit(relative, '/')) {
    shown = shown.empty() ? std::string(part) : absl::StrCat(shown, "/", part);
    const std::string full = Join(shown);
    struct stat st;
    if (lstat(full.c_str(), &st) != 0) {
      if (errno != ENOENT) return ErrnoStatus(errno, "cannot stat", full);
      if (mkdir(full.c_str(), 0755) != 0 && errno != EEXIST) {
        return ErrnoStatus(errno, "cannot create directory", full);
      }
      continue;
    }
    // Checked before anything is created inside it: a symlinked component
    // must not let the server create directories elsewhere.
    if (S_ISLNK(st.st_mode)) {
      if (absl::Status s = CheckResolvesInside(full, shown); !s.ok()) return s;
      if (stat(full.c_str(), &st) != 0) return ErrnoStatus(errno, "cannot stat", full);
    }
    if (!S_ISDIR(st.st_mode)) {
      return absl::FailedPreconditionError(
          absl::StrCat("'", shown, "' under the checkpoint root exists and is not a directory"));
    }
  }
  return CheckResolvesInside(Join(relative), relative);
}

CheckpointRoot::Swept CheckpointRoot::SweepLeftovers(absl::Time older_than) const {
  Swept swept;
  const int64_t cutoff = absl::ToUnixSeconds(older_than);
  // lstat: a real directory or file (never a link) last changed before the cutoff.
  auto stale = [cutoff](const std::string& path, bool directory) {
    struct stat st;
    if (lstat(path.c_str(), &st) != 0) return false;
    if (directory ? !S_ISDIR(st.st_mode) : !S_ISREG(st.st_mode)) return false;
    return st.st_mtime < cutoff;
  };
  auto remove = [&swept](const absl::Status& s, int* counter) {
    if (s.ok()) {
      ++*counter;
    } else {
      ++swept.failed;
    }
  };
  for (const std::string& job : Entries(path_)) {
    if (!ValidateJobId(job).ok() || !IsDirectory(Join(job))) continue;
    for (const std::string& entry : Entries(Join(job))) {
      const std::string relative = absl::StrCat(job, "/", entry);
      if (entry == "consolidated") {
        for (const std::string& out : Entries(Join(relative))) {
          const std::string temp = absl::StrCat(relative, "/", out);
          if (out[0] == '.' && IsTemporaryName(out) && stale(Join(temp), true)) {
            remove(RemoveDir(temp), &swept.directories);
          }
        }
        continue;
      }
      int64_t step = 0;
      if (!ParseCheckpointStepDirName(entry, &step) || !IsDirectory(Join(relative))) continue;
      for (const std::string& file : Entries(Join(relative))) {
        const std::string full = Join(absl::StrCat(relative, "/", file));
        if (!IsTemporaryName(file) || !stale(full, false)) continue;
        remove(unlink(full.c_str()) == 0 ? absl::OkStatus()
                                         : ErrnoStatus(errno, "cannot remove", full),
               &swept.files);
      }
      if (Entries(Join(relative)).empty() && stale(Join(relative), true)) {
        remove(rmdir(Join(relative).c_str()) == 0
                   ? absl::OkStatus()
                   : ErrnoStatus(errno, "cannot remove directory", Join(relative)),
               &swept.directories);
      }
    }
  }
  return swept;
}

absl::Status CheckpointRoot::RemoveDir(absl::string_view relative) const {
  if (absl::Status s = ValidateRelativePath(relative); !s.ok()) return s;
  const std::string full = Join(relative);
  struct stat st;
  if (lstat(full.c_str(), &st) != 0) {
    if (errno == ENOENT) return absl::OkStatus();
    return ErrnoStatus(errno, "cannot stat", full);
  }
  if (S_ISLNK(st.st_mode)) {
    // Never follow a symlinked step directory: remove only the link.
    if (unlink(full.c_str()) != 0) return ErrnoStatus(errno, "cannot remove", full);
    return absl::OkStatus();
  }
  if (absl::Status s = CheckResolvesInside(full, relative); !s.ok()) return s;
  if (!S_ISDIR(st.st_mode)) return ErrnoStatus(ENOTDIR, "cannot open directory", full);
  for (const std::string& name : Entries(full)) {
    std::string path = absl::StrCat(full, "/", name);
    if (lstat(path.c_str(), &st) != 0 || S_ISDIR(st.st_mode)) continue;
    if (unlink(path.c_str()) != 0 && errno != ENOENT) {
      return ErrnoStatus(errno, "cannot remove", path);
    }
  }
  if (rmdir(full.c_str()) != 0 && errno != ENOENT) {
    return ErrnoStatus(errno, "cannot remove directory", full);
  }
  return absl::OkStatus();
}

}  // namespace zeroshard
