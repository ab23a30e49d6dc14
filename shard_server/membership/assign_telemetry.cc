#include "shard_server/membership/assign_telemetry.h"

#include "absl/strings/str_cat.h"
#include "shard_server/goodput/goodput_ledger.h"

namespace zeroshard {
namespace {

absl::Status TooLong(const char* field, size_t size, size_t bound) {
  return absl::InvalidArgumentError(absl::StrCat(
      "HeartbeatRequest.", field, " is ", size, " bytes; at most ", bound,
      " are kept per beat (a worker sends far less: is this client a zeroshard worker?)"));
}

}  // namespace

absl::Status ValidateBeatPayload(const v1::HeartbeatRequest& beat) {
  // The named strings first: their message says which one.
  if (beat.telemetry().in_progress().unit().size() > kMaxUnitNameBytes) {
    return TooLong("telemetry.in_progress.unit", beat.telemetry().in_progress().unit().size(),
                   kMaxUnitNameBytes);
  }
  if (beat.recovery().source().size() > kMaxRecoveryWordBytes) {
    return TooLong("recovery.source", beat.recovery().source().size(), kMaxRecoveryWordBytes);
  }
  if (beat.recovery().phase().size() > kMaxRecoveryWordBytes) {
    return TooLong("recovery.phase", beat.recovery().phase().size(), kMaxRecoveryWordBytes);
  }
  if (beat.telemetry().has_time()) {
    if (absl::Status s =
            ValidateTimeLedger(beat.telemetry().time(), "HeartbeatRequest.telemetry.time");
        !s.ok()) {
      return s;
    }
  }
  // Then the whole of each kept part: fields this server does not know are
  // kept (copied) too.
  if (size_t n = beat.telemetry().ByteSizeLong(); n > kMaxBeatTelemetryBytes) {
    return TooLong("telemetry", n, kMaxBeatTelemetryBytes);
  }
  if (size_t n = beat.last_step().ByteSizeLong(); n > kMaxBeatStepBytes) {
    return TooLong("last_step", n, kMaxBeatStepBytes);
  }
  if (size_t n = beat.recovery().ByteSizeLong(); n > kMaxRecoveryRecordBytes) {
    return TooLong("recovery", n, kMaxRecoveryRecordBytes);
  }
  return ValidateOuterSteps(beat.outer_steps(), "HeartbeatRequest.outer_steps");
}

absl::Status ValidateOuterSteps(
    const google::protobuf::RepeatedPtrField<v1::OuterStepRecord>& records, const char* field) {
  if (records.size() > kMaxOuterStepsPerBeat) {
    return absl::InvalidArgumentError(absl::StrCat(field, " holds ", records.size(),
                                                   " records; at most ", kMaxOuterStepsPerBeat,
                                                   " are taken (a worker sends its last 8)"));
  }
  for (const v1::OuterStepRecord& r : records) {
    if (size_t n = r.ByteSizeLong(); n > kMaxOuterStepRecordBytes || r.workers_size() > 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": a record of ", n, " bytes with ", r.workers_size(),
                       " worker ids; at most ", kMaxOuterStepRecordBytes,
                       " bytes and none are taken (the server names the workers itself)"));
    }
    if (r.outer_step() < 0 || r.after_step() < 0 || r.generation() < 0 || r.groups() < 0 ||
        r.group_size() < 0) {
      return absl::InvalidArgumentError(absl::StrCat(field, ": a record with a negative number (",
                                                     r.ShortDebugString(),
                                                     "); every number is a count or a step, >= 0"));
    }
  }
  return absl::OkStatus();
}

void AssignTelemetry(const v1::RankTelemetry& from, v1::RankTelemetry* to) {
  // Taken out before the Clear() that would delete them; nullptr if absent.
  v1::MemoryUsage* memory = to->release_memory();
  v1::CollectiveInProgress* in_progress = to->release_in_progress();
  v1::TimeLedger* time = to->release_time();
  to->Clear();
  // Put back empty where `from` has one (its strings keep their buffers),
  // for MergeFrom to fill; a field MergeFrom does not know is still copied
  // by it, only with a fresh allocation.
  if (from.has_memory() && memory != nullptr) {
    memory->Clear();
    to->set_allocated_memory(memory);
  } else {
    delete memory;
  }
  if (from.has_in_progress() && in_progress != nullptr) {
    in_progress->Clear();
    to->set_allocated_in_progress(in_progress);
  } else {
    delete in_progress;
  }
  if (from.has_time() && time != nullptr) {
    time->Clear();
    to->set_allocated_time(time);
  } else {
    delete time;
  }
  to->MergeFrom(from);
}

}  // namespace zeroshard
