#include "shard_server/checkpoint_paths.h"

#include <dirent.h>
#include <errno.h>
#include <limits.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <vector>

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
  DIR* dir = opendir(full.c_str());
  if (dir == nullptr) return ErrnoStatus(errno, "cannot open directory", full);
  std::vector<std::string> names;
  while (struct dirent* entry = readdir(dir)) {
    std::string name = entry->d_name;
    if (name != "." && name != "..") names.push_back(std::move(name));
  }
  closedir(dir);
  for (const std::string& name : names) {
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
