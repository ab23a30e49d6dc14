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
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
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
    const BlobDescription& d = blob->description;
    if (!d.received && d.step == step && d.rank == rank && d.world_size == world &&
        d.plan_hash == plan_hash) {
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
    if (!metrics_.rewinds.empty()) {
      metrics_.rewinds.back().cause = verdict.bad() ? RewindCause::kData : RewindCause::kTransient;
    }
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
  mismatch_ = PendingMismatch{step, verdict.replica_mismatches, {}, {}};
  for (const ReplicaMismatch& set : verdict.replica_mismatches) {
    if (std::find(set.ranks.begin(), set.ranks.end(), rank_) == set.ranks.end()) continue;
    // The update of this step was not applied: the state the check hashed.
    absl::StatusOr<std::vector<float>> shard = generation_->engine->CopyMasterShard();
    if (!shard.ok()) return shard.status();
    mismatch_->shard = *std::move(shard);
  }
  rewind_ = RewindRequest{step, target, described};
  return absl::OkStatus();
}

absl::Status Worker::CompareWithFirstRun(int completed) {
  if (!mismatch_.has_value() || completed != mismatch_->step || !mismatch_->deviations.empty()) {
    return absl::OkStatus();
  }
  double deviation = -1;
  if (!mismatch_->shard.empty()) {
    absl::StatusOr<std::vector<float>> now = generation_->engine->CopyMasterShard();
    if (!now.ok()) return now.status();
    deviation = 0;
    for (size_t i = 0; i < now->size() && i < mismatch_->shard.size(); ++i) {
      const double d = std::fabs(static_cast<double>(mismatch_->shard[i]) - (*now)[i]);
      // A NaN or Inf (a flipped top exponent bit) is as far as it gets.
      deviation = std::isfinite(d) ? std::max(deviation, d) : HUGE_VAL;
    }
    mismatch_->shard.clear();
  }
  absl::StatusOr<std::vector<double>> all =
      generation_->engine->GatherOverRanks(deviation, "the shards' differences from the re-run");
  if (!all.ok()) return all.status();
  mismatch_->deviations = *std::move(all);
  return absl::OkStatus();
}

// Every rank of a replica set applied the same updates (the replicas'
// gradients are all-reduced, so one rank's corrupted parameter shifts every
// rank's later updates alike), so after the re-run every replica differs from
// its first-run state a little; the corrupted one also by the flip itself.
// The rank furthest from the re-run is named when it is clearly furthest
// (4x the next in its set); otherwise the line says which set, not which
// rank.
absl::Status Worker::NameCorruptedRanks(int step) {
  const PendingMismatch before = *std::move(mismatch_);
  mismatch_.reset();
  const std::vector<std::string> hosts = MemberHosts();
  auto host_of = [&](int r) { return r < static_cast<int>(hosts.size()) ? hosts[r] : "?"; };
  auto deviation_of = [&](int r) {
    return r < static_cast<int>(before.deviations.size()) ? before.deviations[r] : -1.0;
  };
  std::vector<int> evict;
  for (const ReplicaMismatch& set : before.sets) {
    int furthest = -1;
    double first = -1, second = -1;
    for (int r : set.ranks) {
      const double d = deviation_of(r);
      if (d > first) {
        second = first;
        first = d;
        furthest = r;
      } else {
        second = std::max(second, d);
      }
    }
    std::string line;
    if (furthest >= 0 && first > 0 && first >= 4 * std::max(second, 0.0)) {
      const int count = ++corruptions_[furthest];
      ++corruptions_named_;
      last_corrupted_rank_ = furthest;
      line = absl::StrFormat(
          "rank %d (host %s): its master shard after step %d was up to %g off the re-run's, its "
          "replicas' up to %g: a transient corruption on that rank (%d so far)",
          furthest, host_of(furthest), step, first, std::max(second, 0.0), count);
      if (!metrics_.rewinds.empty()) metrics_.rewinds.back().corrupted_rank = furthest;
      if (count >= 2) evict.push_back(furthest);
    } else {
      line = absl::StrFormat(
          "shard member %d after step %d: the re-run agrees, but its replicas were about as far "
          "off it (up to %g and %g): a transient corruption on one of ranks %s",
          set.member, step, first, second, absl::StrJoin(set.ranks, ","));
    }
    last_corruption_ = line;
    if (rank_ == 0) std::fprintf(stderr, "corrupted shard: %s\n", line.c_str());
  }
  for (int rank : evict) {
    const std::string host = host_of(rank);
    const std::string fenced = AskToEvict(rank, step);
    if (host_of(rank_) != host) continue;
    // This rank shares the host: it stops without a Leave. The server
    // declared it dead with its machine (or, when it could not be asked,
    // does so when its heartbeats stop) and the job shrinks or takes a
    // replacement elsewhere, while the telemetry says why.
    return MarkNumericalStop(absl::FailedPreconditionError(absl::StrCat(
        "evicting host ", host, ": rank ", rank, "'s shard was corrupted ", corruptions_[rank],
        " times (", last_corruption_, "); ", fenced, "; this rank, on that host, stops")));
  }
  return absl::OkStatus();
}

// Every rank asks (the server's EvictHost is idempotent: the first ask
// fences the machine and ends the generation, the others find it fenced),
// so the eviction does not hang on one rank's connection.
std::string Worker::AskToEvict(int rank, int step) {
  const std::string reason =
      absl::StrCat("silent corruption on rank ", rank, " at step ", step,
                   ": its shard was corrupted ", corruptions_[rank], " times (docs/numerics.md)");
  absl::StatusOr<v1::EvictHostResponse> evicted = client_->EvictHost(rank, step, reason);
  if (!evicted.ok()) {
    std::fprintf(stderr,
                 "shard_worker rank %d: the server did not evict rank %d's machine (%s); its "
                 "ranks stop, and the server declares them dead when their heartbeats stop\n",
                 rank_, rank, evicted.status().ToString().c_str());
    return "the server could not be asked to fence it";
  }
  if (rank_ == 0 || !evicted->already()) {
    std::fprintf(stderr,
                 "shard_worker rank %d: the server fenced machine '%s' from the job (%s); its "
                 "joins are refused until `shardctl unfence`\n",
                 rank_, evicted->node().c_str(), reason.c_str());
  }
  return absl::StrCat("the server fenced machine '", evicted->node(), "' from the job");
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
  RewindRecord rewind;
  rewind.bad_step = request.bad_step + 1;
  rewind.to_step = request.to_step;
  rewind.why = request.why;
  metrics_.rewinds.push_back(std::move(rewind));
  if (rank_ == 0) {
    std::fprintf(stderr, "%s; rewound every rank to the snapshot of step %lld, re-running\n",
                 request.why.c_str(), static_cast<long long>(request.to_step));
  }
  ledger_.Rewound(absl::Now(), request.bad_step);  // the bad step's and the rewind's time lost
  return static_cast<int>(request.to_step);
}

}  // namespace zeroshard
