// The recovery agreement through a new generation's KV store (#13): every
// rank publishes what it holds under "recovery/holdings/<rank>"; rank 0 reads
// them all, decides (DecideSource) and publishes "recovery/decision"; the
// others wait for it. The only place the decision is JSON.
#ifndef ZEROSHARD_WORKER_RECOVERY_RECOVERY_AGREEMENT_H_
#define ZEROSHARD_WORKER_RECOVERY_RECOVERY_AGREEMENT_H_

#include <cstdint>
#include <functional>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/plan/shard_plan.h"
#include "worker/comm/kv_store.h"
#include "worker/recovery/recovery_decision.h"
#include "worker/recovery/snapshot_keeper.h"

namespace zeroshard {

// What this rank brings: the blobs `keeper` holds, whether it trained in
// an earlier generation, and its `host` (the member table's).
RankHoldings HoldingsOf(const SnapshotKeeper& keeper, bool survivor, const std::string& host);

// Runs the agreement as `rank` of `world` with the new `plan`. Rank 0 calls
// `latest_disk_step` (-1: no complete disk checkpoint). Each wait on the store
// lasts at most `timeout`. `every_row`: DecideSource's. REQUIRES: 0 <= rank < world.
absl::StatusOr<RecoveryDecision> AgreeOnRecoverySource(
    KeyValueStore* store, int rank, int world, const RankHoldings& mine, const ShardPlan& plan,
    const std::function<int64_t()>& latest_disk_step, absl::Duration timeout,
    bool every_row = false);

}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_RECOVERY_RECOVERY_AGREEMENT_H_
