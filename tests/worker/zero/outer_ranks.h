// Ranks as threads for the DiLoCo engine tests (engine_outer*_test): W ranks
// in shard groups of G consecutive ranks, each with its group's gather and
// reduce communicators, its replicas' (member m of every group; none when
// there is one group), the world's aux and, when asked, its group's own
// step numerics (--outer_timeout's group-local agreement).
#ifndef ZEROSHARD_TESTS_WORKER_ZERO_OUTER_RANKS_H_
#define ZEROSHARD_TESTS_WORKER_ZERO_OUTER_RANKS_H_

#include <cstdint>
#include <functional>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/plan/planner.h"
#include "worker/comm/communicator.h"
#include "worker/comm/in_memory_kv_store.h"
#include "worker/model/mlp.h"
#include "worker/zero/engine.h"

namespace zeroshard {

struct OuterRankComms {
  std::unique_ptr<Communicator> gather, reduce, replicas, aux, numerics;
};

absl::StatusOr<OuterRankComms> ConnectOuterRank(InMemoryKvStore* store, int rank, int world,
                                                int group_size, bool group_numerics = false);

// The plan of `mlp` over `world` ranks in shard groups of `group_size`
// (alignment 4 elements).
absl::StatusOr<ShardPlan> PlanOuterMlp(const MlpConfig& mlp, int world, int group_size);

// The engine's parameters from `model`'s rows of `seed`.
absl::Status InitializeFromSeed(ZeroEngine& engine, const Model& model, uint64_t seed);

// Runs body(rank) on `world` threads and joins them.
void OnRankThreads(int world, const std::function<void(int)>& body);

}  // namespace zeroshard

#endif  // ZEROSHARD_TESTS_WORKER_ZERO_OUTER_RANKS_H_
