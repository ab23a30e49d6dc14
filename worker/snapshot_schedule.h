// The in-memory snapshots of a training run (#13, docs/recovery.md), as the
// training thread drives them: buffers reserved after a generation's first
// step, a snapshot at every --snapshot_every boundary (one small collective
// commits the last complete one; a transfer still in flight is waited for),
// and
// the wait for the background copy before the optimizer changes the state.
// The blobs themselves live in the SnapshotKeeper it owns, across generations.
//
// Not thread-safe: the training thread calls it (the keeper's own thread
// does the copying).
#ifndef ZEROSHARD_WORKER_SNAPSHOT_SCHEDULE_H_
#define ZEROSHARD_WORKER_SNAPSHOT_SCHEDULE_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "worker/checkpoint/shard_checkpoint.h"
#include "worker/comm/gloo_communicator.h"
#include "worker/recovery/snapshot_keeper.h"
#include "worker/run_report.h"
#include "worker/zero/engine.h"

namespace zeroshard {

class SnapshotSchedule {
 public:
  // `metrics` outlives it; the snapshots' pauses and times go there.
  // `buddy_always`: swap a copy with the buddy even where the replicas hold
  // the rows (--snapshot_buddy=always); otherwise, in HSDP with R >= 2
  // replicas, each snapshot holds this rank's run and its replica peer's
  // (ZeroEngine::replica_peer), and nothing is swapped.
  SnapshotSchedule(const std::string& optimizer, absl::Duration timeout, bool buddy_always,
                   RunMetrics* metrics)
      : optimizer_(optimizer), timeout_(timeout), buddy_always_(buddy_always), metrics_(metrics) {}

  // The buffers, ready before the first snapshot: own and the buddy's, for
  // the step being taken and the committed one. Called after a generation's
  // first step, which a recovery waits for, rather than competing with it
  // for the CPUs.
  absl::Status Reserve(ZeroEngine& engine, int world);
  // The boundary after `id.step` completed steps: commit, then start a
  // snapshot of `engine` swapped with the buddy `buddy_shift` ranks on over
  // `comm`. A rank whose last transfer is still in flight waits for it
  // (bounded by the transfer's timeout; the buffers' first touch, by
  // kReserveWait); when one is still busy after that, every rank skips this
  // snapshot. `on_device`: the engine's state is in device memory (copied
  // here, the pause) rather than host memory (copied in the background).
  absl::Status Take(ZeroEngine& engine, const ShardIdentity& id, GlooCommunicator* comm,
                    int buddy_shift, bool on_device);
  // Before every optimizer step: waits for the snapshot's copy out of the
  // engine (normally long done), adding the wait to the snapshot's pause.
  void WaitCopied();
  // The transfer in flight's error.
  absl::Status Wait() { return keeper_.Wait(); }
  // A generation ends: its communicators are aborted, so the transfer in
  // flight ends now.
  void EndGeneration();

  SnapshotKeeper& keeper() { return keeper_; }
  const SnapshotKeeper& keeper() const { return keeper_; }

 private:
  // The boundary's vote: every rank's complete step and whether it is busy.
  // Sets the commit; the ranks still busy (empty: take the snapshot).
  absl::StatusOr<std::vector<int>> VoteAndCommit(ZeroEngine& engine, bool busy);
  // Records the times of the last completed transfer once.
  void RecordLastTransfer();
  // This generation's snapshots take the replica peer's run, not a buddy copy.
  bool FromReplicas(const ZeroEngine& engine) const {
    return !buddy_always_ && engine.replica_peer() >= 0;
  }

  const std::string optimizer_;
  const absl::Duration timeout_;
  const bool buddy_always_;
  RunMetrics* const metrics_;
  SnapshotKeeper keeper_;
  // A snapshot started at the last boundary may still be copying the
  // engine's state.
  bool copy_pending_ = false;
  // Reserve's first touch of the buffers may still run (until a boundary
  // finds nothing in flight): a boundary waits for it only up to
  // kReserveWait, since touching gigabytes on a loaded machine took longer
  // than ten steps of seed 001's model (recovery_bench: a 5.8 s pause).
  bool reserving_ = false;
  int64_t last_reported_transfer_ = -1;  // the snapshot step whose times metrics_ has
};

}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_SNAPSHOT_SCHEDULE_H_
