#include "worker/recovery/recovery_agreement.h"

#include <cassert>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"

namespace zeroshard {
namespace {

constexpr char kDecisionKey[] = "recovery/decision";

std::string HoldingsKey(int rank) { return absl::StrCat("recovery/holdings/", rank); }

absl::StatusOr<std::vector<RankHoldings>> ReadEveryRanksHoldings(KeyValueStore* store, int world,
                                                                 absl::Duration timeout) {
  std::vector<RankHoldings> holdings;
  for (int r = 0; r < world; ++r) {
    absl::StatusOr<std::string> got = store->Get(HoldingsKey(r), timeout);
    if (!got.ok()) return got.status();
    absl::StatusOr<RankHoldings> parsed = RankHoldingsFromJson(*got);
    if (!parsed.ok()) return parsed.status();
    holdings.push_back(*std::move(parsed));
  }
  return holdings;
}

}  // namespace

RankHoldings HoldingsOf(const SnapshotKeeper& keeper, bool survivor, const std::string& host) {
  RankHoldings mine;
  mine.survivor = survivor;
  mine.host = host;
  for (const auto& blob : keeper.Holdings()) mine.blobs.push_back(blob->description);
  return mine;
}

absl::StatusOr<RecoveryDecision> AgreeOnRecoverySource(
    KeyValueStore* store, int rank, int world, const RankHoldings& mine, const ShardPlan& plan,
    const std::function<int64_t()>& latest_disk_step, absl::Duration timeout, bool every_row) {
  assert(rank >= 0 && rank < world);
  if (absl::Status s = store->Set(HoldingsKey(rank), RankHoldingsToJson(mine)); !s.ok()) return s;
  if (rank != 0) {
    absl::StatusOr<std::string> decided = store->Get(kDecisionKey, timeout);
    if (!decided.ok()) return decided.status();
    return RecoveryDecisionFromJson(*decided);
  }
  absl::StatusOr<std::vector<RankHoldings>> holdings =
      ReadEveryRanksHoldings(store, world, timeout);
  if (!holdings.ok()) return holdings.status();
  // The disk is read only when some rank has state (as before: a fresh job
  // never lists the checkpoint root here).
  const int64_t disk_step = AnyRankHasState(*holdings) ? latest_disk_step() : -1;
  const RecoveryDecision decision = DecideSource(*holdings, plan, disk_step, every_row);
  if (absl::Status s = store->Set(kDecisionKey, RecoveryDecisionToJson(decision)); !s.ok()) {
    return s;
  }
  return decision;
}

}  // namespace zeroshard
