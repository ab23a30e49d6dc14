#include "worker/comm/comm_internal.h"

#include "absl/strings/str_cat.h"

namespace zeroshard {
namespace comm_internal {

absl::Status CheckCall(const char* name, int rank, int world_size, const std::string& tag,
                       bool aborted, const absl::Status& broken, int64_t count, DType dtype,
                       absl::Duration timeout) {
  const std::string who =
      absl::StrCat("communicator (rank ", rank, " of ", world_size, ", tag '", tag, "')");
  if (aborted && broken.ok()) {
    return absl::UnavailableError(absl::StrCat(name, ": ", who, " was aborted; create a new one"));
  }
  if (!broken.ok()) {
    return absl::UnavailableError(
        absl::StrCat(name, ": ", who,
                     " is unusable after an earlier failure; create a new one. Earlier failure: ",
                     broken.message()));
  }
  if (count < 0) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": negative count ", count));
  }
  if (!Supported(dtype)) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": dtype ", DTypeName(dtype), " is not supported (F32 and BF16 are)"));
  }
  if (timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": timeout must be positive, got ", absl::FormatDuration(timeout)));
  }
  return absl::OkStatus();
}

absl::Status CheckBlocks(const char* name, const std::vector<ShardBlock>& blocks, int rank,
                         int world_size, const void* full, const void* shard,
                         BlockGroups* groups) {
  if (absl::Status status = ValidateBlocks(name, blocks, world_size); !status.ok()) {
    return status;
  }
  *groups = GroupBlocks(blocks, world_size);
  if (groups->full_extent > 0 &&
      (full == nullptr || (groups->total[rank] > 0 && shard == nullptr))) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": null buffer"));
  }
  return absl::OkStatus();
}

}  // namespace comm_internal
}  // namespace zeroshard
