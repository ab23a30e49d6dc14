// A member's telemetry, replaced by each beat's.
#ifndef ZEROSHARD_SHARD_SERVER_MEMBERSHIP_ASSIGN_TELEMETRY_H_
#define ZEROSHARD_SHARD_SERVER_MEMBERSHIP_ASSIGN_TELEMETRY_H_

#include <cstddef>

#include "absl/status/status.h"
#include "proto/zeroshard.pb.h"

namespace zeroshard {

// What one beat may make the server keep (docs/design.md's security table):
// a member keeps its latest beat's telemetry and last step, a job its last
// 32 recovery records. Each is refused (INVALID_ARGUMENT) beyond these
// serialized sizes, far above what a worker sends (telemetry ~60 bytes
// while a collective is in flight, a record ~60 bytes), so a job's held
// beat data is at most world size x (kMaxBeatTelemetryBytes +
// kMaxBeatStepBytes) + 32 x kMaxRecoveryRecordBytes. The time ledger
// (RankTelemetry.time, ~140 bytes: 15 doubles) fits in the telemetry's
// bound beside a full collective in progress; its numbers are checked too
// (finite, >= 0: ValidateTimeLedger).
inline constexpr size_t kMaxBeatTelemetryBytes = 1024;
inline constexpr size_t kMaxBeatStepBytes = 128;
inline constexpr size_t kMaxRecoveryRecordBytes = 256;
// A collective's unit name (a layer or parameter group) and a record's
// source and phase, each within the sizes above.
inline constexpr size_t kMaxUnitNameBytes = 256;
inline constexpr size_t kMaxRecoveryWordBytes = 32;

// A beat's or a leave's DiLoCo outer steps (OuterStepRecord): at most
// kMaxOuterStepsPerBeat, each at most kMaxOuterStepRecordBytes (a worker
// sends ~20 bytes, no worker ids: the server fills them), numbers >= 0.
inline constexpr int kMaxOuterStepsPerBeat = 8;
inline constexpr size_t kMaxOuterStepRecordBytes = 64;
absl::Status ValidateOuterSteps(
    const google::protobuf::RepeatedPtrField<v1::OuterStepRecord>& records, const char* field);

// OK when `beat`'s telemetry, last step and recovery record are within the
// bounds above; else which field, its size and the bound.
absl::Status ValidateBeatPayload(const v1::HeartbeatRequest& beat);

// *to = from, keeping `to`'s sub-messages where `from` has them: on a heap
// message, proto3's Clear() (which `*to = from` starts with) deletes every
// sub-message, so each beat cost 4 frees and 4 allocations (its memory, its
// collective in progress and that one's unit name, a string object and its
// buffer; now 5 with the time ledger of the first ranks), every second, per rank, on whichever of
// the server's threads took the beat (assign_telemetry_test counts them). `to` must not be on an
// arena.
void AssignTelemetry(const v1::RankTelemetry& from, v1::RankTelemetry* to);

}  // namespace zeroshard

#endif  // ZEROSHARD_SHARD_SERVER_MEMBERSHIP_ASSIGN_TELEMETRY_H_
