#include "common/plan/shard_groups.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace zeroshard {

absl::StatusOr<ShardGroups> ShardGroups::Make(int world, int shard_group_size, int secondary) {
  if (world < 1) {
    return absl::InvalidArgumentError(absl::StrCat("world size ", world, ": expected >= 1"));
  }
  if (shard_group_size < 0 || (shard_group_size > 0 && world % shard_group_size != 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("shard_group_size ", shard_group_size, " does not divide the world size ",
                     world, "; expected a divisor of it (or 0: shard over every rank)"));
  }
  const int g = shard_group_size > 0 && shard_group_size < world ? shard_group_size : world;
  if (secondary < 0 || (secondary > 0 && (world % secondary != 0 || secondary >= g))) {
    return absl::InvalidArgumentError(absl::StrCat(
        "secondary_shard_group_size ", secondary, " must be 0 (no hpZ) or divide the world size ",
        world, " and be smaller than the shard groups of ", g, " ranks"));
  }
  return ShardGroups(world, shard_group_size, secondary);
}

}  // namespace zeroshard
