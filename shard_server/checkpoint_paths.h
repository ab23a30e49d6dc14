// Names under the checkpoint root, and the checks that keep every read and
// write of the server below it.
//
//   <root>/<job>/step-<N>/rank-<R>-of-<W>.safetensors   a rank's shard file
//   <root>/<job>/step-<N>/manifest.json                 written last, by the server
//   <root>/<job>/consolidated/step-<N>/                 Consolidate(on_server)
//
// Paths from the wire are relative to the root. They are refused when
// absolute, when a component is empty, "." or "..", and when a file or a
// directory resolves (symlinks followed) outside realpath(root).
#ifndef ZEROSHARD_SHARD_SERVER_CHECKPOINT_PATHS_H_
#define ZEROSHARD_SHARD_SERVER_CHECKPOINT_PATHS_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace zeroshard {

inline constexpr char kManifestFileName[] = "manifest.json";

// "<job>/step-<N>"
std::string CheckpointStepDir(absl::string_view job, int64_t step);
// "rank-<R>-of-<W>.safetensors"
std::string CheckpointShardFileName(int rank, int world_size);
// "<job>/step-<N>/rank-<R>-of-<W>.safetensors"
std::string CheckpointShardPath(absl::string_view job, int64_t step, int rank, int world_size);
// "<job>/consolidated/step-<N>"
std::string ConsolidatedDir(absl::string_view job, int64_t step);

// OK when `job` is one path-safe name: letters, digits, '-', '_', '.', not
// starting with '.' or '-' (what Membership accepts as a job id).
// INVALID_ARGUMENT naming the value otherwise.
absl::Status ValidateCheckpointJobId(absl::string_view job);

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

#endif  // ZEROSHARD_SHARD_SERVER_CHECKPOINT_PATHS_H_
