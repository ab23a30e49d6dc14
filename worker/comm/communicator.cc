#include "worker/comm/communicator.h"

#include "absl/strings/str_cat.h"

namespace zeroshard {

absl::Status ValidateBlocks(const char* collective, const std::vector<ShardBlock>& blocks,
                            int world_size) {
  for (size_t i = 0; i < blocks.size(); ++i) {
    const ShardBlock& b = blocks[i];
    if (b.rank < 0 || b.rank >= world_size) {
      return absl::InvalidArgumentError(absl::StrCat(collective, ": block ", i, " belongs to rank ",
                                                     b.rank, ", not in [0, ", world_size, ")"));
    }
    if (b.shard_offset < 0 || b.full_offset < 0 || b.count < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          collective, ": block ", i, " has a negative offset or count (shard_offset ",
          b.shard_offset, ", full_offset ", b.full_offset, ", count ", b.count, ")"));
    }
  }
  return absl::OkStatus();
}

}  // namespace zeroshard
