// A member's telemetry, replaced by each beat's.
#ifndef ZEROSHARD_SHARD_SERVER_MEMBERSHIP_ASSIGN_TELEMETRY_H_
#define ZEROSHARD_SHARD_SERVER_MEMBERSHIP_ASSIGN_TELEMETRY_H_

#include "proto/zeroshard.pb.h"

namespace zeroshard {

// *to = from, keeping `to`'s sub-messages where `from` has them: on a heap
// message, proto3's Clear() (which `*to = from` starts with) deletes every
// sub-message, so each beat cost 4 frees and 4 allocations (its memory, its
// collective in progress and that one's unit name, a string object and its
// buffer), every second, per rank, on whichever of the server's threads took
// the beat (assign_telemetry_test counts them). `to` must not be on an
// arena.
void AssignTelemetry(const v1::RankTelemetry& from, v1::RankTelemetry* to);

}  // namespace zeroshard

#endif  // ZEROSHARD_SHARD_SERVER_MEMBERSHIP_ASSIGN_TELEMETRY_H_
