// shardctl spec / plan. (Being written.)
#include "client/shardctl_commands.h"

namespace zeroshard {

int SpecCommand() { return Fail(absl::UnimplementedError("shardctl spec is not built yet")); }
int PlanCommand() { return Fail(absl::UnimplementedError("shardctl plan is not built yet")); }

}  // namespace zeroshard
