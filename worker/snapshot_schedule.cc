#include "worker/snapshot_schedule.h"

#include <algorithm>
#include <cstdio>
#include <limits>
#include <memory>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/status_context.h"

namespace zeroshard {
namespace {

// What the training thread copies, or lends the keeper's thread to copy.
// `with_replica_peer`: the replica peer's run too (SnapshotSchedule).
absl::StatusOr<ShardView> ViewForSnapshot(ZeroEngine& engine, const ShardIdentity& id,
                                          const std::string& optimizer, bool on_device,
                                          bool with_replica_peer) {
  if (!on_device) {
    // The engine's own host memory: the keeper's thread copies it while the
    // next step's forward and backward run (WaitCopied before the optimizer
    // changes it).
    return ViewShard(engine, id, optimizer, true, with_replica_peer);
  }
  // Device memory: copied to the host here (the pause).
  absl::StatusOr<ShardSnapshot> copy =
      SnapshotShard(engine, id, optimizer, /*with_optimizer=*/true, with_replica_peer);
  if (!copy.ok()) return copy.status();
  return ViewOf(std::make_shared<const ShardSnapshot>(*std::move(copy)));
}

}  // namespace

absl::Status SnapshotSchedule::Reserve(ZeroEngine& engine, int world) {
  absl::StatusOr<ShardView> view = ViewShard(engine, {}, optimizer_, true, FromReplicas(engine));
  if (!view.ok()) return Annotate(view.status(), "snapshot");
  constexpr int64_t kHeaderBytes = int64_t{1} << 20;  // room for the safetensors header
  // Own and buddy's blob for two steps; from replicas, own only (twice the
  // run, no buddy's).
  keeper_.Reserve(view->bytes + kHeaderBytes, world > 1 && !FromReplicas(engine) ? 4 : 2);
  reserving_ = true;
  return absl::OkStatus();
}

void SnapshotSchedule::RecordLastTransfer() {
  for (std::string& refusal : keeper_.TakeRefusals()) {
    std::fprintf(stderr, "snapshot refused: %s\n", refusal.c_str());
    metrics_->snapshot_refusals.push_back(std::move(refusal));
  }
  if (keeper_.last_transfer_ms() > 0 && keeper_.complete_step() > last_reported_transfer_) {
    last_reported_transfer_ = keeper_.complete_step();
    metrics_->snapshot_copy_ms.push_back(keeper_.last_copy_ms());
    metrics_->snapshot_transfer_ms.push_back(keeper_.last_transfer_ms());
  }
}

// One small collective decides two things: the commit (the latest step every
// rank has complete, own and buddy's copy) and whether to skip this snapshot
// because a rank's previous transfer is still in flight after the wait's
// bound (then every rank skips: the buddy swap needs both sides); and it checks that every rank
// runs with the same --snapshot_buddy (a mix would leave one side of a swap
// waiting). Each rank sends 4 * (complete_step + 1) + 2 * buddy_always +
// in_flight.
absl::StatusOr<std::vector<int>> SnapshotSchedule::VoteAndCommit(ZeroEngine& engine, bool busy) {
  absl::StatusOr<std::vector<double>> votes =
      engine.GatherOverRanks(4.0 * static_cast<double>(keeper_.complete_step() + 1) +
                                 (buddy_always_ ? 2 : 0) + (busy ? 1 : 0),
                             "snapshot commit");
  if (!votes.ok()) {
    return Annotate(votes.status(), "snapshot commit");
  }
  int64_t committed = std::numeric_limits<int64_t>::max();
  std::vector<int> busy_ranks, buddy_always;
  for (size_t r = 0; r < votes->size(); ++r) {
    const int64_t vote = static_cast<int64_t>((*votes)[r]);
    if (vote % 2 == 1) busy_ranks.push_back(static_cast<int>(r));
    if (vote / 2 % 2 == 1) buddy_always.push_back(static_cast<int>(r));
    committed = std::min(committed, vote / 4 - 1);
  }
  if (!buddy_always.empty() && buddy_always.size() != votes->size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank(s) ", absl::StrJoin(buddy_always, ","),
                     " run with --snapshot_buddy=always and the "
                     "others with auto: give every rank the same --snapshot_buddy"));
  }
  keeper_.Commit(committed);
  metrics_->snapshot_committed_step = keeper_.committed_step();
  return busy_ranks;
}

absl::Status SnapshotSchedule::Take(ZeroEngine& engine, const ShardIdentity& id,
                                    GlooCommunicator* comm, int buddy_shift, bool on_device) {
  const absl::Time start = absl::Now();
  // The previous transfer still in flight (a loaded machine, a slow link):
  // wait for it rather than skip, so that a boundary always leaves a
  // snapshot a recovery or a rewind can go back to. Normally it ended long
  // ago and this costs nothing; the wait counts in the pause. Bounded by
  // the transfer's own timeout (it fails by then). The buffers' first touch
  // (Reserve) is waited for only up to kReserveWait: a small model's takes
  // milliseconds (a loaded machine skipped rewind_test's first snapshots
  // for it), a large one's can take seconds, which the step must not pause
  // for. A rank still busy after its bound makes every rank skip, as before.
  constexpr absl::Duration kReserveWait = absl::Milliseconds(500);
  bool busy = keeper_.in_flight();
  if (busy) {
    ++metrics_->snapshots_waited;
    busy = !keeper_.WaitIdle(reserving_ ? std::min(kReserveWait, timeout_) : timeout_);
  }
  if (!busy) reserving_ = false;
  if (!busy) {
    if (absl::Status s = keeper_.Wait(); !s.ok()) return Annotate(s, "snapshot");
    RecordLastTransfer();
  }
  absl::StatusOr<std::vector<int>> busy_ranks = VoteAndCommit(engine, busy);
  if (!busy_ranks.ok()) return busy_ranks.status();
  if (!busy_ranks->empty()) {
    ++metrics_->snapshots_skipped;
    if (id.rank == 0) {
      std::fprintf(stderr,
                   "shard_worker rank %d: snapshot of step %lld skipped: the previous snapshot's "
                   "transfer (or the first touch of the snapshot buffers) is still in flight on "
                   "rank(s) %s after the wait's bound (%d skipped so far)\n",
                   id.rank, static_cast<long long>(id.step),
                   absl::StrJoin(*busy_ranks, ",").c_str(), metrics_->snapshots_skipped);
    }
    metrics_->snapshot_pause_ms.push_back(absl::ToDoubleMilliseconds(absl::Now() - start));
    return absl::OkStatus();
  }
  absl::StatusOr<ShardView> view =
      ViewForSnapshot(engine, id, optimizer_, on_device, FromReplicas(engine));
  if (!view.ok()) return Annotate(view.status(), "snapshot");
  // No buddy swap when the replicas hold the rows (a null comm: complete as
  // soon as copied).
  GlooCommunicator* buddies = FromReplicas(engine) ? nullptr : comm;
  if (FromReplicas(engine)) ++metrics_->snapshots_from_replicas;
  if (absl::Status s = keeper_.Start(*std::move(view), buddies, buddy_shift, timeout_); !s.ok()) {
    return Annotate(s, "snapshot");
  }
  copy_pending_ = true;
  metrics_->snapshot_pause_ms.push_back(absl::ToDoubleMilliseconds(absl::Now() - start));
  return absl::OkStatus();
}

void SnapshotSchedule::WaitCopied() {
  if (!copy_pending_) return;
  // The optimizer is about to change the state a snapshot may still be
  // copying: the rest of the snapshot's pause, normally nothing.
  const absl::Time wait = absl::Now();
  keeper_.WaitCopied();
  copy_pending_ = false;
  if (!metrics_->snapshot_pause_ms.empty()) {
    metrics_->snapshot_pause_ms.back() += absl::ToDoubleMilliseconds(absl::Now() - wait);
  }
}

void SnapshotSchedule::EndGeneration() {
  keeper_.Wait().IgnoreError();
  copy_pending_ = false;
}

}  // namespace zeroshard
