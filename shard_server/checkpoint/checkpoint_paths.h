// The checks that keep every read and write of the server below its
// checkpoint root (the names under it: common/checkpoint_format.h).
//
// Paths from the wire are relative to the root. They are refused when
// absolute, when a component is empty, "." or "..", and when a file or a
// directory resolves (symlinks followed) outside realpath(root).
#ifndef ZEROSHARD_SHARD_SERVER_CHECKPOINT_CHECKPOINT_PATHS_H_
#define ZEROSHARD_SHARD_SERVER_CHECKPOINT_CHECKPOINT_PATHS_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "common/checkpoint_format.h"
#include "common/job_id.h"

namespace zeroshard {

// OK for a relative path whose components are neither empty, "." nor "..".
// INVALID_ARGUMENT naming the value otherwise.
absl::Status ValidateRelativePath(absl::string_view relative);

// The checkpoint root directory. Copyable; immutable after Open.
class CheckpointRoot {
 public:
  // Creates `root` (and its parents) if missing and resolves its real path.
  static absl::StatusOr<CheckpointRoot> Open(const std::string& root);

  const std::string& path() const { return path_; }
  const std::string& real_path() const { return real_path_; }

  // path() + "/" + relative. REQUIRES: ValidateRelativePath(relative) is OK.
  std::string Join(absl::string_view relative) const;

  // OK when the existing file `relative` and its directory both resolve
  // below the root. NOT_FOUND if the file is missing; FAILED_PRECONDITION
  // naming the path and where it leads otherwise.
  absl::Status CheckInside(absl::string_view relative) const;

  // Creates directory `relative` and any missing parents below the root. An
  // existing component that is a symlink must resolve below the root
  // (FAILED_PRECONDITION otherwise), and nothing is created beyond it.
  absl::Status MakeDirs(absl::string_view relative) const;

  // What a crash leaves behind below the root, last changed before
  // `older_than`: temporary shard files ("<job>/step-<N>/*.tmp-<16 hex>"),
  // consolidation outputs never renamed into place
  // ("<job>/consolidated/.step-<N>.tmp-<16 hex>/"), and step directories left
  // empty. Removed; symlinks are never followed (a symlinked entry is left
  // alone). Best effort: what cannot be removed is left and counted.
  struct Swept {
    int files = 0;
    int directories = 0;
    int failed = 0;
  };
  Swept SweepLeftovers(absl::Time older_than) const;

  // Removes directory `relative` (which must resolve below the root): the
  // files and symlinks directly in it, then the directory itself. A
  // subdirectory is left alone and makes the final rmdir fail.
  absl::Status RemoveDir(absl::string_view relative) const;

 private:
  CheckpointRoot(std::string path, std::string real_path)
      : path_(std::move(path)), real_path_(std::move(real_path)) {}
  bool IsBelowRoot(const std::string& real) const;
  absl::Status CheckResolvesInside(const std::string& full, absl::string_view shown) const;

  std::string path_;
  std::string real_path_;
};

}  // namespace zeroshard

#endif  // ZEROSHARD_SHARD_SERVER_CHECKPOINT_CHECKPOINT_PATHS_H_
