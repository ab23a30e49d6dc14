// The worker's rewinds (issue #43, docs/numerics.md): a bad step that a
// re-run may cure sends every rank back to the last committed in-memory
// snapshot, which every rank holds its own blob of (worker/recovery/
// snapshot_keeper.h), and training goes on from there in the same process
// and generation: no re-join, no transfer.
//
//   A loss spike (--loss_spike_zscore; under it a non-finite step too):
//   rewind and re-run. If the same step is bad again, the cause is its data
//   or the model, and --on_nonfinite decides (skip or stop); if not, the
//   first run's was transient.
//
//   A replica mismatch (--replica_check_every): rewind and re-run. When the
//   re-run's check at the same step agrees, the rank whose hash changed is
//   the one whose shard was corrupted: it is named (and reported to the
//   server in the heartbeats' telemetry); a rank corrupted a second time
//   evicts its host: every rank there stops, and the job shrinks or takes a
//   replacement as for a host that died. A mismatch again at the same step is
//   a persistent fault, and the run stops.
//
// Every rank decides alike: the verdicts are the same bits on every rank,
// and the committed snapshot step is agreed by a collective.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/checkpoint_format.h"
#include "common/status_context.h"
#include "worker/replica_check.h"
#include "worker/worker.h"

namespace zeroshard {
namespace {

// This rank's own blob of `step` under `plan_hash` at `world`, or null.
std::shared_ptr<const SnapshotBlob> OwnBlob(const SnapshotKeeper& keeper, int64_t step, int rank,
                                            int world, const std::string& plan_hash) {
  for (std::shared_ptr<const SnapshotBlob>& blob : keeper.Holdings()) {
    if (!blob->received && blob->step == step && blob->rank == rank && blob->world_size == world &&
        blob->plan_hash == plan_hash) {
      return blob;
    }
  }
  return nullptr;
}

}  // namespace

absl::StatusOr<int64_t> Worker::AgreeOnRewindTarget(int64_t limit) {
  if (config_.recovery.snapshot_every == 0) return -1;
  ZeroEngine& e = *generation_->engine;
  if (absl::Status s = snapshots_.Wait(); !s.ok()) return Annotate(s, "snapshot");
  const SnapshotKeeper& keeper = snapshots_.keeper();
  absl::StatusOr<std::vector<double>> complete = e.GatherOverRanks(
      static_cast<double>(keeper.CompleteStepAtMost(limit)), "the snapshot steps to rewind to");
  if (!complete.ok()) return complete.status();
  int64_t target = limit;
  for (double step : *complete) target = std::min(target, static_cast<int64_t>(step));
  if (target < 0) return -1;
  // A step complete everywhere but older than a later commit was dropped.
  const bool held = OwnBlob(keeper, target, rank_, world(), generation_->plan.hash) != nullptr;
  absl::StatusOr<std::vector<double>> holding =
      e.GatherOverRanks(held ? 1.0 : 0.0, "the snapshots held");
  if (!holding.ok()) return holding.status();
  for (double h : *holding) {
    if (h == 0) return -1;
  }
  return target;
}

absl::Status Worker::OnBadStep(int step, const StepVerdict& verdict, bool* handled) {
  *handled = false;
  if (!spikes_.enabled()) return absl::OkStatus();
  if (verdict.loss_spike) ++loss_spikes_;
  const std::string where = absl::StrCat("step ", step + 1, "/", config_.schedule.steps, ": ");
  const bool rerun = spike_rewound_step_ == step;
  if (rerun) {
    spike_rewound_step_ = -1;
    const char* cause = verdict.bad() ? "data" : "transient";
    if (!metrics_.rewinds.empty()) metrics_.rewinds.back()["cause"] = cause;
    if (rank_ == 0) {
      std::fprintf(
          stderr, "%s\n",
          verdict.bad()
              ? absl::StrCat(where, "bad again after the rewind (", verdict.Describe(),
                             "): the cause is this step's data or the model, not a transient "
                             "fault; --on_nonfinite decides")
                    .c_str()
              : absl::StrFormat("%sno spike after the rewind (loss %g): the first run's was "
                                "transient, a fault in some rank's memory or arithmetic rather "
                                "than the data",
                                where, verdict.mean_loss)
                    .c_str());
    }
  }
  if (!verdict.bad() || rerun) return absl::OkStatus();
  // Before the bad step, and at least one step before it: a fault in the
  // state after the last step shows in this step's loss.
  absl::StatusOr<int64_t> target = AgreeOnRewindTarget(step - 1);
  if (!target.ok()) return target.status();
  if (*target < 0) {
    if (rank_ == 0) {
      std::fprintf(
          stderr,
          "%s%s; no in-memory snapshot complete on every rank to rewind to (--snapshot_every=%d); "
          "--on_nonfinite decides\n",
          where.c_str(), verdict.Describe().c_str(), config_.recovery.snapshot_every);
    }
    return absl::OkStatus();
  }
  spike_rewound_step_ = step;
  rewind_ = RewindRequest{step, *target, absl::StrCat(where, verdict.Describe())};
  *handled = true;
  return absl::OkStatus();
}

absl::Status Worker::OnReplicaMismatch(int step, const StepVerdict& verdict) {
  ++replica_mismatches_;
  const std::string described = DescribeReplicaMismatch(verdict.replica_mismatches.front(), step,
                                                        config_.schedule.steps, MemberHosts());
  const bool again = mismatch_.has_value() && mismatch_->step == step;
  int64_t target = -1;
  if (!again) {
    // No later than the last check the replicas passed: a snapshot taken
    // after the corruption holds it.
    absl::StatusOr<int64_t> agreed = AgreeOnRewindTarget(last_verified_step_);
    if (!agreed.ok()) return agreed.status();
    target = *agreed;
  }
  if (target < 0) {
    mismatch_.reset();
    return MarkNumericalStop(absl::FailedPreconditionError(absl::StrCat(
        described,
        again ? "; the replicas differ again after re-running from the last snapshot: a "
                "persistent fault (a rank's memory or arithmetic gets it wrong every time); "
                "stopping: the snapshot and checkpoints before it hold good state"
              : kReplicaStop)));
  }
  mismatch_ = PendingMismatch{step, verdict.checksums};
  rewind_ = RewindRequest{step, target, described};
  return absl::OkStatus();
}

absl::Status Worker::NameCorruptedRanks(int step, const StepVerdict& verdict) {
  const PendingMismatch before = *std::move(mismatch_);
  mismatch_.reset();
  const std::vector<std::string> hosts = MemberHosts();
  std::vector<int> evict;
  for (size_t r = 0; r < before.checksums.size() && r < verdict.checksums.size(); ++r) {
    if (before.checksums[r] == verdict.checksums[r]) continue;
    const int rank = static_cast<int>(r);
    const int count = ++corruptions_[rank];
    const std::string host = rank < static_cast<int>(hosts.size()) ? hosts[rank] : "?";
    last_corruption_ = absl::StrFormat(
        "rank %d (host %s): its master shard after step %d held XXH64 %016x, and %016x, as its "
        "replicas, when re-run from the snapshot: a transient corruption on that rank (%d so far)",
        rank, host, step, before.checksums[r], verdict.checksums[r], count);
    if (rank_ == 0) std::fprintf(stderr, "corrupted shard: %s\n", last_corruption_.c_str());
    if (!metrics_.rewinds.empty()) metrics_.rewinds.back()["corrupted_rank"] = rank;
    if (count >= 2) evict.push_back(rank);
  }
  for (int rank : evict) {
    const std::string& host = hosts[rank];
    if (hosts[rank_] != host) continue;
    // This rank shares the host: it leaves the job the way a dead host's
    // ranks do (no Leave), so the server ends the generation and the job
    // shrinks or waits for a replacement, while the telemetry says why.
    return MarkNumericalStop(absl::FailedPreconditionError(absl::StrCat(
        "evicting host ", host, ": rank ", rank, "'s shard was corrupted ", corruptions_[rank],
        " times (", last_corruption_, "); this rank, on that host, stops")));
  }
  return absl::OkStatus();
}

absl::StatusOr<int> Worker::Rewind() {
  const RewindRequest request = *std::move(rewind_);
  rewind_.reset();
  ZeroEngine& e = *generation_->engine;
  // The snapshot in flight reads the engine's state and may hold the bad
  // step's neighbours: done before anything is loaded or dropped.
  if (absl::Status s = snapshots_.Wait(); !s.ok()) return Annotate(s, "snapshot");
  absl::Status loaded;
  std::shared_ptr<const SnapshotBlob> own =
      OwnBlob(snapshots_.keeper(), request.to_step, rank_, world(), generation_->plan.hash);
  if (own == nullptr) {
    loaded = absl::InternalError("this rank's own blob of that step is gone");
  } else {
    // Its tensors' XXH64s were checked as it was made (SerializeShardInto).
    absl::StatusOr<std::unique_ptr<CheckpointReader>> reader = CheckpointReader::OpenMemory(
        absl::StrCat("snapshot of step ", request.to_step),
        {{CheckpointShardFileName(rank_, world()), own->bytes}}, /*verified=*/true);
    loaded = reader.ok() ? LoadFrom(reader->get()) : reader.status();
  }
  // Every rank rewinds or none goes on.
  absl::StatusOr<std::vector<double>> outcomes =
      e.GatherOverRanks(loaded.ok() ? 1.0 : 0.0, "the rewind's outcome");
  if (!outcomes.ok()) return outcomes.status();
  for (size_t r = 0; r < outcomes->size(); ++r) {
    if ((*outcomes)[r] != 0) continue;
    return MarkNumericalStop(absl::FailedPreconditionError(absl::StrCat(
        request.why, "; the rewind to the snapshot of step ", request.to_step, " failed on rank ",
        r, static_cast<int>(r) == rank_ ? absl::StrCat(" (", loaded.message(), ")") : "",
        "; stopping")));
  }
  snapshots_.keeper().DropNewerThan(request.to_step);
  spikes_.RewindTo(request.to_step);
  if (config_.replica_check_every > 0 && e.group_size() < e.world_size()) {
    // A snapshot taken after a corruption holds it: the replicas must agree
    // on what they loaded.
    absl::Status s = CheckReplicas(e, request.to_step, config_.schedule.steps, MemberHosts());
    if (!s.ok()) {
      return Annotate(s, absl::StrCat(request.why, "; rewound to the snapshot of step ",
                                      request.to_step, ", whose replicas differ too"));
    }
  }
  metrics_.rewinds.push_back(
      {{"bad_step", request.bad_step + 1}, {"to_step", request.to_step}, {"why", request.why}});
  if (rank_ == 0) {
    std::fprintf(stderr, "%s; rewound every rank to the snapshot of step %lld, re-running\n",
                 request.why.c_str(), static_cast<long long>(request.to_step));
  }
  return static_cast<int>(request.to_step);
}

}  // namespace zeroshard
