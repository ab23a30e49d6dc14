// What a recovering job does once its --rejoin_grace is over: form a smaller
// generation, keep waiting for survivors on their way, or fail. Pure:
// Membership::MaybeShrink (shard_server/membership/shrink.cc) gathers who
// re-joined and who did not, and applies the decision.
//
// The grace bounds the wait for the *missing* members (a dead rank that a
// launcher may replace), not for the survivors: a survivor can be slow to
// come back (a loaded host, a long pause of its process), and failing the job
// while it is on its way loses a recovery that was about to succeed (issue
// #50: on a 2-core machine at load 9-13, one survivor of three re-joined after
// a 1-s grace, and the job failed with 2 of the 3 it needed). So, after the
// grace:
//   1. At least --min_world_size members re-joined: the generation forms with
//      them (at once; a member arriving later grows the job back).
//   2. Fewer re-joined, but with the members that can still come there would
//      be enough: wait for those. A member can still come while it is live:
//      not left, and alive by the failure detector (its heartbeats still
//      arrive, or its silence is within --heartbeat_timeout_ms and the
//      detector's other allowances; failure_detector.h). The wait ends at
//      rule 1 when they come, at rule 3 when they die or leave, or when the
//      re-joins' own deadlines (the workers' --rejoin_timeout) pass.
//   3. Otherwise fail every waiting re-join, naming who re-joined, who could
//      still come and who cannot (dead or left).
// Before the grace is over the generation waits for all its members.
//
// Whole shard groups (world_multiple m > 1, the workers' numeric
// --shard_group_size): a generation's size must be a multiple of m, so the
// rules count the re-joined in whole groups: rule 1 forms with the largest
// multiple of m of them (form_size) once that reaches --min_world_size
// rounded up to a multiple of m, and the others wait to grow the job back
// (Membership::MaybeShrink parks them); rules 2 and 3 count the re-joined
// plus the live missing the same way. Everyone in forms at once only when
// they are a multiple of m.
#ifndef ZEROSHARD_SHARD_SERVER_MEMBERSHIP_REJOIN_WAIT_H_
#define ZEROSHARD_SHARD_SERVER_MEMBERSHIP_REJOIN_WAIT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/time/time.h"

namespace zeroshard {

// A member of the job's last formed generation that has not re-joined.
struct MissingMember {
  std::string worker_id;
  int rank = 0;
  bool live = false;  // not left, and alive by the failure detector
  bool left = false;  // left cleanly (not live); otherwise declared dead
};

struct RejoinState {
  std::string job_id;
  int64_t generation = 0;  // the generation being formed
  int world_size = 0;      // members it would have at full size
  int min_world_size = 0;  // --min_world_size; 0: never shrink
  int world_multiple = 0;  // JoinRequest.world_multiple; 0 or 1: any size
  absl::Duration rejoin_grace;
  bool grace_over = false;
  std::vector<std::string> rejoined;   // worker ids of the waiting joins, sorted
  std::vector<MissingMember> missing;  // by rank
  // Until the first waiting join's deadline (the workers' --rejoin_timeout);
  // InfiniteDuration without one.
  absl::Duration deadline_left = absl::InfiniteDuration();
};

enum class RejoinAction {
  kWaitForAll,   // the grace is not over (or the job never shrinks)
  kForm,         // rule 1 (or every member is in)
  kWaitForLive,  // rule 2
  kFail,         // rule 3
};

struct RejoinDecision {
  RejoinAction action = RejoinAction::kWaitForAll;
  // kForm: how many of the re-joined form the generation: all of them, or
  // (whole shard groups) the largest multiple of world_multiple.
  int form_size = 0;
  // kWaitForLive: the live missing members' worker ids, by rank.
  std::vector<std::string> waiting_for;
  // kWaitForLive: what the server waits for, in words (status, event log);
  // kFail: the error every waiting join is answered with.
  std::string message;
};

RejoinDecision DecideRejoin(const RejoinState& state);

}  // namespace zeroshard

#endif  // ZEROSHARD_SHARD_SERVER_MEMBERSHIP_REJOIN_WAIT_H_
