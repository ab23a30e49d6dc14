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
  transfers_ = nlohmann::json::array();
  recovering_ = true;  // a replacement too: its first step completes the record
}

void RecoveryTimeline::Transferred(const std::vector<SnapshotTransfer>& transfers) {
  transfers_ = nlohmann::json::array();
  for (const SnapshotTransfer& t : transfers) {
    transfers_.push_back({{"from", t.from},
                          {"to", t.to},
                          {"old_rank", t.old_rank},
                          {"kind", std::string(TransferKindName(t.kind))}});
  }
}

std::optional<nlohmann::json> RecoveryTimeline::FirstStepDone(absl::Time now) {
  if (!recovering_) return std::nullopt;
  recovering_ = false;
  if (record_.generation() <= 0) return std::nullopt;
  const bool saw_failure = record_.failed_step() >= 0;
  record_.set_first_step_ms(absl::ToDoubleMilliseconds(now - (saw_failure ? failure_ : joined_)));
  record_.set_phase("training");
  return nlohmann::json{
      {"generation", record_.generation()},
      {"source", record_.source()},
      {"restored_step", record_.restored_step()},
      {"failed_step", record_.failed_step()},
      {"world_size", record_.world_size()},
      {"rejoin_ms", record_.rejoin_ms()},
      {"restore_ms", record_.restore_ms()},
      {"first_step_ms", record_.first_step_ms()},
      {"transfers", transfers_},
      // Wall-clock times, for benchmarks that kill from outside (ms since the
      // Unix epoch; 0: not this process's).
      {"failure_seen_unix_ms", saw_failure ? absl::ToUnixMillis(seen_) : 0},
      // The server's verdict that ended the generation (0: none
      // came); rejoin_ms and first_step_ms count from it when set.
      {"verdict_unix_ms", saw_failure && from_verdict_ ? absl::ToUnixMillis(failure_) : 0},
      {"confirmed_unix_ms", saw_failure ? absl::ToUnixMillis(confirmed_) : 0},
      {"joined_unix_ms", absl::ToUnixMillis(joined_)},
      {"first_step_unix_ms", absl::ToUnixMillis(now)}};
}

}  // namespace zeroshard
