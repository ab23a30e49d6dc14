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
#include "nlohmann/json.hpp"
#include "proto/zeroshard.pb.h"
#include "worker/recovery/recovery_decision.h"

namespace zeroshard {

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
  std::optional<nlohmann::json> FirstStepDone(absl::Time now);

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
  nlohmann::json transfers_ = nlohmann::json::array();
};

}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_RECOVERY_RECOVERY_TIMELINE_H_
