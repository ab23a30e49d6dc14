// shardctl checkpoints / consolidate. (Being written.)
#include "client/shardctl_commands.h"

namespace zeroshard {

int CheckpointsCommand() {
  return Fail(absl::UnimplementedError("shardctl checkpoints is not built yet"));
}
int ConsolidateCommand() {
  return Fail(absl::UnimplementedError("shardctl consolidate is not built yet"));
}

}  // namespace zeroshard
