// The member table: what Membership keeps of each job (its generation, its
// members by rank, the joins it holds) and the order in which the timer
// looks at its live members. Private to Membership's own files
// (membership.h declares these types; everything else sees Membership's
// calls only).
#ifndef ZEROSHARD_SHARD_SERVER_MEMBERSHIP_MEMBER_TABLE_H_
#define ZEROSHARD_SHARD_SERVER_MEMBERSHIP_MEMBER_TABLE_H_

#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "proto/zeroshard.pb.h"
#include "shard_server/goodput/goodput_ledger.h"
#include "shard_server/membership/membership.h"
#include "shard_server/membership/silence_order.h"

namespace zeroshard {

struct Membership::MemberState {
  int rank = 0;
  std::string worker_id;
  std::string host;
  std::string token;
  bool alive = true;
  bool left = false;
  absl::Time last_heartbeat;  // formation time until the first beat
  bool heartbeat_seen = false;
  int64_t step = 0;
  double loss = 0;
  int64_t memory_bytes = 0;
  int64_t collective_seq = 0;
  v1::StepTelemetry last_step;
  std::string incarnation;     // JoinRequest.incarnation
  std::string node;            // JoinRequest.node: "<hostname> <boot id>"; "" if not sent
  int rejoins = 0;             // generations it was a member of, less one
  int64_t snapshot_step = -1;  // the member's latest committed snapshot
  // When the stream of its latest beat closed (InfinitePast: not since the
  // member formed). A kill -9 closes it at once: the kernel sends FIN.
  absl::Time stream_closed = absl::InfinitePast();
  uint64_t beating_stream = 0;  // the stream of its latest beat
  v1::RankTelemetry telemetry;
};
// LeaveRequest.failure's largest size, and how a FAILED job's history
// entry starts (the failure follows).
inline constexpr size_t kMaxFailureBytes = 1024;
inline constexpr char kJobFailedPrefix[] = "job failed: ";

struct Membership::PendingJoin {
  uint64_t id = 0;
  std::string worker_id;
  std::string host;
  std::string incarnation;
  std::string node;  // JoinRequest.node
  bool skip_member_table = false;
  ClockStart clock = ClockStart::kAtFormation;
  absl::Time deadline;
  absl::Time joined_at;  // when the join came
  // A re-joined survivor that a shrink to whole shard groups left out: why,
  // in words ("'w2' (rank 2: its shard group, ranks 2-3, lost 'w3')"). It
  // waits in the formed job as a grower (MaybeShrink, shrink.cc).
  std::string parked;
  JoinDone done;
};
struct Membership::Job {
  std::string id;
  int world_size = 0;
  // The world size the workers were started with; world_size is smaller
  // after a shrink.
  int target_world_size = 0;
  // From the members' joins (--min_world_size, --rejoin_grace); 0: no
  // shrink. A restored job takes them from its next join.
  int min_world_size = 0;
  // The largest JoinRequest.world_multiple of its joins (0: any world size);
  // in memory: after a server restart, the next join's.
  int world_multiple = 0;
  absl::Duration rejoin_grace = absl::ZeroDuration();
  bool recovery_options_known = false;
  // When the current generation was started by a death (shrink counts the
  // grace from here); InfinitePast otherwise.
  absl::Time degraded_at = absl::InfinitePast();
  // FAILED: who failed and why ("worker 'w0' (rank 0) failed: ..."), for
  // the refusals of its members' re-joins. In memory only: the processes
  // (JoinRequest.incarnation) are not saved, so after a server restart a
  // join to a FAILED job starts it again, whoever sends it (the history
  // keeps the failure).
  std::string failure;
  // A restart of an ended job (FINISHED or FAILED) whose generation has not
  // formed: the state it ended in, which it goes back to when the restart's
  // last join times out (tick.cc); UNSPECIFIED otherwise.
  v1::JobState restarted_from = v1::JOB_STATE_UNSPECIFIED;
  int64_t generation = 0;          // current generation (forming or formed)
  int64_t members_generation = 0;  // generation of `members`; == generation once formed
  v1::JobState state = v1::JOINING;
  // By worker id: sorted = rank order. While the job is formed, only
  // workers growing a shrunk job back (kGrowBack) wait here.
  std::map<std::string, PendingJoin> pending;
  // Grow back: the snapshot step every live member had committed when the
  // first waiting grower came (-1: none), and when it came (InfinitePast:
  // nobody waits). The generation ends once every member committed a later
  // one (Tick).
  int64_t grow_mark = -1;
  absl::Time grow_since = absl::InfinitePast();
  std::vector<MemberState> members;  // by rank
  // The live members of `members` by their last beat (RebuildSilenceOrder
  // after `members` changes wholesale), and the ranks whose latest stream
  // closed since their last beat: what Tick judges, so a tick costs what
  // the silent members cost, not the job.
  SilenceOrder silence;
  absl::flat_hash_set<int> closed_streams;
  // Live members of the formed generation whose clock has not started
  // (ClockStart::kAtFirstBeat): not in `silence`, so not judged, until
  // they beat, their answer proves undeliverable, or `delivery_deadline`
  // passes.
  // Invariant: disjoint from `silence`.
  absl::flat_hash_set<int> undelivered;
  absl::Time delivery_deadline = absl::InfiniteFuture();
  // OK, or why the last save of a death (applied, not yet saved) failed.
  absl::Status unsaved;
  // The state store's commit that holds the job's last saved change: what
  // must be durable (SyncState) before a member hears of it. Set by
  // Persist, which sees the job const.
  mutable int64_t commit = 0;
  // Since when the job has had no live member and no pending join
  // (InfiniteFuture while it has one).
  absl::Time idle_since = absl::InfiniteFuture();
  // Why each generation began, the last kMaxHistory of them, oldest first.
  // Saved with the job (Persist): a restarted server still shows them.
  struct GenerationChange {
    int64_t seq = 0;  // numbers the job's entries, from 1
    int64_t generation = 0;
    std::string reason;
    absl::Time at;
  };
  std::deque<GenerationChange> history;
  std::map<std::string, int> joins;           // worker id -> generations it was a member of
  std::deque<v1::RecoveryRecord> recoveries;  // the last kMaxHistory, oldest first
  // --sync=diloco: the last kMaxOuterSteps outer steps rank 0 reported
  // (RecordOuterSteps), oldest first; in memory only, like `recoveries`.
  static constexpr size_t kMaxOuterSteps = 16;
  std::deque<v1::OuterStepRecord> outer_steps;
  // Machines fenced from the job (EvictHost), by node: their joins are
  // refused until UnfenceHost. Saved with the job (the fenced_hosts table).
  std::map<std::string, v1::FencedHost> fences;
  // The generation in which a member reported a failed collective
  // (HeartbeatRequest.peer_failure; -1: none): its silent members are
  // declared dead sooner (Tick).
  int64_t suspect_generation = -1;
  // heartbeat_resumed lines of the current second (LogResumed): at most
  // kResumedListed are written; the others are counted and summed up in
  // one heartbeats_resumed_unlisted line. A server that was itself behind
  // at 100K ranks logged 100,000 lines at once, and took the CPU to write
  // them from the beats it was behind on.
  absl::Time resumed_window = absl::InfinitePast();
  int resumed_listed = 0;
  int resumed_unlisted = 0;
  absl::Duration resumed_unlisted_longest;
  // When a beating member of the formed generation last reported a larger
  // collective_seq (InfinitePast: not in this generation): its silent peers
  // are seen by it (failure_detector.h, rule 3).
  absl::Time data_plane_advanced = absl::InfinitePast();
  // The server suspects its own isolation from this job, or members are
  // silent but seen by their peers (each logged once per episode).
  bool isolation_suspected = false;
  bool seen_by_peers = false;
  bool server_behind = false;  // a death held by rule 4b (logged once)
  // Whom the last recovery_waiting line named (MaybeShrink logs a change).
  std::vector<std::string> waiting_logged;
  // Where the job's wall clock went (goodput.cc), and its row in the state
  // store's goodput table: saved on phase changes, and by Tick at most
  // every kGoodputSaveEvery while it changed.
  GoodputLedger goodput;
  bool goodput_changed = false;
  absl::Time goodput_saved_at = absl::InfinitePast();
  bool goodput_save_failing = false;  // logged once until a save succeeds
  // The earliest last sign of life of the members of the formed generation
  // the failure detector declared dead (InfiniteFuture: none): where the
  // generation's running time ends (GoodputLedger::GenerationEnded).
  absl::Time death_evidence = absl::InfiniteFuture();
  // When this server restored the job (InfinitePast: it did not), and the
  // generation of its members then: a restored member that has not beaten
  // since was last seen at the restore.
  absl::Time restored_at = absl::InfinitePast();
  int64_t restored_generation = 0;
  bool formed() const { return members_generation == generation && !members.empty(); }
  // The member with `worker_id`; null: none. O(1): a 100,000-rank job's
  // rejoins after a failure look up every member once each.
  MemberState* FindMember(const std::string& worker_id);
  const MemberState* FindMember(const std::string& worker_id) const;
  // Call whenever `members` is replaced or filled (restore, FormGeneration).
  void IndexMembers();
  // Invariant: rank_by_worker[m.worker_id] == m.rank for every m of
  // `members`, and nothing else (IndexMembers).
  absl::flat_hash_map<std::string, int> rank_by_worker;

  // Sorts the live members by their last beat into `silence` and forgets
  // closed streams: after `members` changed wholesale (a formation, a
  // restore, a grace). O(W log W).
  void RebuildSilenceOrder();
  // A member stopped being live (dead, left): out of the timer's sight.
  void StopWatching(int rank);
  // Starts the clock of an `undelivered` member at `now` (it beat, or its
  // answer could not be delivered): from here it is judged like every
  // member.
  void StartClock(int rank, absl::Time now);
  // The latest snapshot step every live member committed (-1: none).
  int64_t CommittedSnapshot() const;
  // `size` plus the growers waiting in a formed job, at most its target
  // world size.
  int WithGrowers(int size) const;
};

}  // namespace zeroshard

#endif  // ZEROSHARD_SHARD_SERVER_MEMBERSHIP_MEMBER_TABLE_H_
