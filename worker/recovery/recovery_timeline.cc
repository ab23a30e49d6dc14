#include "worker/recovery/recovery_timeline.h"

#include <string>

namespace zeroshard {

void RecoveryTimeline::FailureSeen(absl::Time seen, absl::Time confirmed, int64_t failed_step,
                                   absl::Time verdict) {
  from_verdict_ = verdict != absl::InfinitePast();
  failure_ = from_verdict_ ? verdict : seen;
  seen_ = seen;
  confirmed_ = confirmed;
  failed_step_ = failed_step;
  recovering_ = true;
}

void RecoveryTimeline::Restored(int64_t generation, RecoverySource source, int64_t step, int world,
                                absl::Time now) {
  record_ = v1::RecoveryRecord();
  record_.set_generation(generation);
  record_.set_source(std::string(RecoverySourceName(source)));
  record_.set_restored_step(step);
  record_.set_failed_step(recovering_ ? failed_step_ : -1);
  record_.set_world_size(world);
  if (recovering_) record_.set_rejoin_ms(absl::ToDoubleMilliseconds(joined_ - failure_));
  record_.set_restore_ms(absl::ToDoubleMilliseconds(now - joined_));
  record_.set_phase("restored");
  transfers_.clear();
  recovering_ = true;  // a replacement too: its first step completes the record
}

void RecoveryTimeline::Transferred(const std::vector<SnapshotTransfer>& transfers) {
  transfers_ = transfers;
}

std::optional<RecoveryReport> RecoveryTimeline::FirstStepDone(absl::Time now) {
  if (!recovering_) return std::nullopt;
  recovering_ = false;
  if (record_.generation() <= 0) return std::nullopt;
  const bool saw_failure = record_.failed_step() >= 0;
  record_.set_first_step_ms(absl::ToDoubleMilliseconds(now - (saw_failure ? failure_ : joined_)));
  record_.set_phase("training");
  RecoveryReport report;
  report.record = record_;
  report.transfers = transfers_;
  report.failure_seen_unix_ms = saw_failure ? absl::ToUnixMillis(seen_) : 0;
  report.verdict_unix_ms = saw_failure && from_verdict_ ? absl::ToUnixMillis(failure_) : 0;
  report.confirmed_unix_ms = saw_failure ? absl::ToUnixMillis(confirmed_) : 0;
  report.joined_unix_ms = absl::ToUnixMillis(joined_);
  report.first_step_unix_ms = absl::ToUnixMillis(now);
  return report;
}

}  // namespace zeroshard
