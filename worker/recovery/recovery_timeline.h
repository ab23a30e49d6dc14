// The times of one worker's recoveries (#13): when it saw the failure, when
// the server confirmed it, when the new generation formed, when state was
// restored and when the first step after completed. What the heartbeat's
// RecoveryRecord and the run report's "recoveries" carry.
//
// Not thread-safe: the training thread owns it.
#ifndef ZEROSHARD_WORKER_RECOVERY_RECOVERY_TIMELINE_H_
#define ZEROSHARD_WORKER_RECOVERY_RECOVERY_TIMELINE_H_

#include <cstdint>
#include <optional>
#include <vector>

#include "absl/time/time.h"
#include "common/fault_messages.h"
#include "proto/zeroshard.pb.h"
#include "worker/recovery/recovery_decision.h"

namespace zeroshard {

// One recovery as the run report lists it ("recoveries"; written out as
// JSON by run_report.cc).
struct RecoveryReport {
  // Generation, source, steps, world size and the times from the failure
  // (or from the join) to the rejoin, the restore and the first step.
  v1::RecoveryRecord record;
  // The snapshot blobs that moved in the restore (every rank's, as decided).
  std::vector<SnapshotTransfer> transfers;
  // Wall-clock times, for benchmarks that kill from outside (ms since the
  // Unix epoch; 0: not this process's): when this worker saw the failure,
  // the server's verdict that ended the generation (0: none came;
  // rejoin_ms and first_step_ms count from it when set), the server's
  // abort that confirmed it, the new generation's join and its first step.
  int64_t failure_seen_unix_ms = 0;
  int64_t verdict_unix_ms = 0;
  int64_t confirmed_unix_ms = 0;
  int64_t joined_unix_ms = 0;
  int64_t first_step_unix_ms = 0;
  // Filled in by the worker from the new generation's batch layout: this
  // rank's micro-batches a step, all ranks' together, and whether the step
  // is the original world size's (--keep_global_batch).
  int grad_accum = 0;
  int64_t micro_batches_per_step = 0;
  bool global_batch_kept = false;
};

class RecoveryTimeline {
 public:
  // A failure ended a generation at `failed_step`: seen at `seen`, confirmed
  // by the server's abort at `confirmed`, decided by the server at `verdict`
  // (its member_dead verdict, carried by the abort; InfinitePast: no time
  // came). recovering() from here. The record's times count from the
  // verdict when there is one (the same instant on every rank), else from
  // `seen`.
  void FailureSeen(absl::Time seen, absl::Time confirmed, int64_t failed_step,
                   absl::Time verdict = absl::InfinitePast());
  // A generation formed (Join returned).
  void Joined(absl::Time now) { joined_ = now; }
  // Between FailureSeen (or a restore into a running job) and the first step
  // after it.
  bool recovering() const { return recovering_; }

  // State came back from `source` at `step` in `generation` of `world` ranks.
  // Starts a new record; a replacement too is recovering() until its first
  // step.
  void Restored(int64_t generation, RecoverySource source, int64_t step, int world, absl::Time now);
  // The snapshot blobs that moved in that restore (every rank's, as decided),
  // for the record's "transfers": who sent which old rank's blob, and whether
  // from a replica or a buddy's copy. Call after Restored.
  void Transferred(const std::vector<SnapshotTransfer>& transfers);
  // The first step after a restore completed: ends recovering() and, for a
  // generation after the first, returns the run report's record of it.
  std::optional<RecoveryReport> FirstStepDone(absl::Time now);

  // The latest record (generation 0: none).
  const v1::RecoveryRecord& record() const { return record_; }
  // The event the latest record's first_step_ms counts from.
  RecoveryClock measured_from() const {
    if (record_.failed_step() < 0) return RecoveryClock::kJoined;
    return from_verdict_ ? RecoveryClock::kVerdict : RecoveryClock::kSeen;
  }

 private:
  bool recovering_ = false;
  absl::Time failure_;  // the verdict's time, or when this worker saw the failure
  absl::Time seen_;     // when this worker saw it
  bool from_verdict_ = false;
  absl::Time confirmed_;  // when the server's abort confirmed it
  absl::Time joined_;
  int64_t failed_step_ = 0;
  v1::RecoveryRecord record_;
  std::vector<SnapshotTransfer> transfers_;
};

}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_RECOVERY_RECOVERY_TIMELINE_H_
