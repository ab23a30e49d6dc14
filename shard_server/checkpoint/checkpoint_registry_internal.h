// What the registry's files share: the clock in Unix ms and the delete of a
// step's rows. Internal to //shard_server/checkpoint:checkpoint_registry.
#ifndef ZEROSHARD_SHARD_SERVER_CHECKPOINT_CHECKPOINT_REGISTRY_INTERNAL_H_
#define ZEROSHARD_SHARD_SERVER_CHECKPOINT_CHECKPOINT_REGISTRY_INTERNAL_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "shard_server/state/state_store.h"

namespace zeroshard::checkpoint_registry_internal {

int64_t NowUnixMs();

// Forgets (job, step): its commits and verification outcomes and, unless
// `commits_only`, the step itself. Part of the caller's transaction.
absl::Status DeleteStepRows(StateStore::Connection& db, const std::string& job, int64_t step,
                            bool commits_only);

}  // namespace zeroshard::checkpoint_registry_internal

#endif  // ZEROSHARD_SHARD_SERVER_CHECKPOINT_CHECKPOINT_REGISTRY_INTERNAL_H_
