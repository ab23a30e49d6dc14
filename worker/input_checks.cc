#include "worker/input_checks.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "worker/checkpoint/shard_checkpoint.h"
#include "worker/data/token_shards.h"

namespace zeroshard {
namespace {

absl::Status Bad(const std::string& why) { return absl::InvalidArgumentError(why); }

// MemTotal of /proc/meminfo in bytes, or 0 when unreadable.
int64_t MachineMemory() {
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  int64_t kb = 0;
  std::string unit;
  while (meminfo >> key >> kb >> unit) {
    if (key == "MemTotal:") return kb * 1024;
  }
  return 0;
}

std::string GiB(double bytes) { return absl::StrFormat("%.1f GiB", bytes / (1 << 30)); }

// `path` (of flag `flag`) is a regular file, or a directory when
// `directory_ok`; lstat's view is not enough (a symlink to a FIFO), so stat.
absl::Status RegularFile(const std::string& flag, const std::string& path, bool directory_ok) {
  struct stat st;
  if (stat(path.c_str(), &st) != 0) {
    return Bad(absl::StrCat("--", flag, ": cannot read ", path, " (", std::strerror(errno), ")"));
  }
  if (S_ISREG(st.st_mode) || (directory_ok && S_ISDIR(st.st_mode))) return absl::OkStatus();
  const char* kind = S_ISFIFO(st.st_mode)   ? "a FIFO"
                     : S_ISSOCK(st.st_mode) ? "a socket"
                     : S_ISCHR(st.st_mode)  ? "a character device"
                     : S_ISBLK(st.st_mode)  ? "a block device"
                     : S_ISDIR(st.st_mode)  ? "a directory"
                                            : "not a regular file";
  return Bad(absl::StrCat("--", flag, ": ", path, " is ", kind,
                          "; give a regular file (the worker reads it by offset)"));
}

// The data inputs: a glob of token shards, or one file.
absl::Status CheckData(const std::string& flag, const std::string& data) {
  if (data.empty()) return absl::OkStatus();
  std::vector<std::string> paths = {data};
  if (data.find_first_of("*?[") != std::string::npos) {
    absl::StatusOr<std::vector<std::string>> matched = ExpandGlob(flag, data);
    if (!matched.ok()) return matched.status();
    paths = *std::move(matched);
  }
  for (const std::string& path : paths) {
    if (absl::Status s = RegularFile(flag, path, /*directory_ok=*/false); !s.ok()) return s;
  }
  return absl::OkStatus();
}

// --init_from: a regular file (or a Hugging Face directory, whose files the
// reader checks alike), opened now: its header is parsed and the file's
// size checked against it (SafetensorsReader: DATA_LOSS when truncated).
absl::Status CheckInitFrom(const std::string& init_from) {
  if (init_from.empty()) return absl::OkStatus();
  if (absl::Status s = RegularFile("init_from", init_from, /*directory_ok=*/true); !s.ok()) {
    return s;
  }
  absl::StatusOr<std::unique_ptr<CheckpointReader>> opened = CheckpointReader::OpenFile(init_from);
  if (!opened.ok()) {
    return Bad(
        absl::StrCat("--init_from=", init_from, " cannot be used: ", opened.status().message()));
  }
  return absl::OkStatus();
}

// Where the checkpoints go, when they go anywhere: made if missing, a
// directory this process can write (found out now, not after the first
// checkpoint's steps).
absl::Status CheckCheckpointDir(const WorkerConfig& config) {
  const std::string& dir = config.checkpoint.dir;
  if (dir.empty() || (!config.checkpoint.enabled() && config.initial.resume_flag.empty())) {
    return absl::OkStatus();
  }
  std::error_code error;
  std::filesystem::create_directories(dir, error);
  if (error || !std::filesystem::is_directory(dir, error)) {
    return Bad(absl::StrCat("--checkpoint_dir=", dir, ": cannot make it a directory (",
                            error ? error.message() : "a file is in the way",
                            "); pass a directory this user can write"));
  }
  if (access(dir.c_str(), W_OK | X_OK) != 0) {
    return Bad(absl::StrCat("--checkpoint_dir=", dir, " is not writable (", std::strerror(errno),
                            "); pass a directory this user can write"));
  }
  return absl::OkStatus();
}

}  // namespace

double ModelParameters(const TaskOptions& task) {
  if (task.model == "gpt") {
    const double c = task.d_model;
    const double vocab = task.vocab > 0 ? task.vocab : 50257;  // the most a default takes
    const double positions = std::max<double>(task.positions, task.context);
    // Per block: two LayerNorms (4C), attention (4C^2 + 4C), MLP (8C^2 + 5C).
    return (vocab + positions) * c + task.layers * (12 * c * c + 13 * c) + 2 * c;
  }
  const double width = task.width;
  return task.layers * (width * width + width);
}

double RankStateBytes(const TaskOptions& task, int world_size) {
  const double params = ModelParameters(task);
  const double c = task.model == "gpt" ? task.d_model : task.width;
  const double block = task.model == "gpt" ? 12 * c * c + 13 * c : c * c + c;
  return 16 * params / std::max(world_size, 1) + 4 * block;
}

absl::Status CheckInputsBeforeJoining(const WorkerConfig& config, int64_t machine_bytes) {
  if (machine_bytes <= 0) machine_bytes = MachineMemory();
  const double state = RankStateBytes(config.task, config.world_size);
  if (machine_bytes > 0 && state > static_cast<double>(machine_bytes)) {
    return Bad(absl::StrFormat(
        "the model (%s, %.3g parameters) needs at least %s per rank at %d ranks (16 bytes a "
        "parameter for its f32 weights, gradients and Adam moments, sharded, plus a block "
        "gathered), more than this machine's %s of memory; use a smaller model or more ranks",
        config.task.model, ModelParameters(config.task), GiB(state), config.world_size,
        GiB(static_cast<double>(machine_bytes))));
  }
  if (absl::Status s = CheckInitFrom(config.initial.init_from); !s.ok()) return s;
  if (absl::Status s = CheckCheckpointDir(config); !s.ok()) return s;
  if (absl::Status s = CheckData("data", config.task.data); !s.ok()) return s;
  return CheckData("val_data", config.task.val_data);
}

}  // namespace zeroshard
