// Which silent members of a job are dead, as far as the server can tell. Pure:
// Membership::Tick gathers the signals and applies the verdicts.
//
// The server sees a member only through its heartbeats, and silence has three
// causes a cluster's network makes common: the member died; the member is cut
// off from the server but not from its peers (a partition); the server itself
// is cut off (its host's link, its switch port). Only the first is a death.
// A death the server sees directly comes first: a process that is gone
// closes its connection (the kernel sends FIN or RST), a silent network does
// not. The rules, in order, for each live member:
//
//   0. In a formed generation, a member whose latest heartbeat stream closed
//      while it was beating (within kAbruptCloseWindow of its last beat: a
//      keepalive timeout of a silent connection closes it only seconds after
//      the last bytes) and that has not beaten since within
//      max(kClosedStreamReopenWait, 2 intervals) (a live client whose own
//      keepalive dropped the connection reconnects and beats within that) is
//      dead: its process is gone. A killed member is declared dead about two
//      seconds after the kill, whatever its peers report.
//   1. After a peer reported a failed collective in this generation (the
//      data plane stopped, so someone is gone), a member is dead when its
//      heartbeat stream closed more than kReopenGrace ago without a beat
//      since, or when it missed 1.5 heartbeat intervals. Fast, and safe: the
//      data plane already stopped.
//   2. A member that beat within the heartbeat timeout is alive.
//   3. Seen by its peers: while members that do beat report the data plane
//      advancing (their collective_seq grew within the heartbeat timeout), a
//      silent member is alive. Every collective of a ZeRO step involves every
//      rank, so it cannot advance without the silent member; the member only
//      lost the server.
//   4. The server suspects itself: when no live member of the job beat
//      within the timeout (all fell silent within one timeout of each other,
//      or rule 5 would have caught the earlier ones), or none within 1.5
//      heartbeat intervals (a beating member is never that late) when a
//      member's rule 3 evidence has just run out, the likelier cause is the
//      server's own network. Nobody is declared dead until isolation_grace
//      after the last beat the server heard.
//   4b. The server was behind: when its own call queues lagged more than
//      half an interval since a silent member's last beat (ShardServer
//      measures it: an alarm on each queue, timed when its thread gets to
//      it; `MemberSignals::server_lag` is the worst reading since that beat,
//      ServerLag), the member's answer or next beat may have waited in them
//      (a worker beats one interval after the answer to its last, and the
//      timeout already allows for that interval: a server D behind makes a
//      member look D more silent). Its timeout is extended by that lag, at
//      most by isolation_grace. A 100K-rank simulated job on a saturated
//      machine declared live hosts dead without it (docs/scale.md).
//   5. Otherwise the member is dead (heartbeat timeout).
//
// Worst cases, written where they are relied on (docs/multihost.md):
//   - A whole job dying at once (every host down) is declared dead
//     isolation_grace later than the heartbeat timeout. Nobody waits on that:
//     there is no survivor to recover, and a restarted worker (a new
//     incarnation) is admitted at once.
//   - A server isolated for longer than timeout + isolation_grace declares
//     everyone dead: one recovery when the network returns, as before.
//   - A server cut off together with some ranks (it shares their host) hears
//     those ranks, whose collectives stall: the others are declared dead
//     after the timeout and the job recovers when the network returns.
//   - A member that dies while partitioned from the server is declared dead
//     one heartbeat timeout after the data plane last advanced, i.e. later by
//     at most one step and one heartbeat interval.
#ifndef ZEROSHARD_SHARD_SERVER_MEMBERSHIP_FAILURE_DETECTOR_H_
#define ZEROSHARD_SHARD_SERVER_MEMBERSHIP_FAILURE_DETECTOR_H_

#include <deque>
#include <string>
#include <utility>
#include <vector>

#include "absl/time/time.h"
#include "common/keepalive.h"

namespace zeroshard {

struct FailureDetectorOptions {
  absl::Duration heartbeat_interval = absl::Seconds(1);
  absl::Duration heartbeat_timeout = absl::Seconds(3);
  // Rule 4's wait (the server's --isolation_grace); zero: rule 4 is off.
  absl::Duration isolation_grace = absl::ZeroDuration();
};

// Rule 4b's extension of the heartbeat timeout while the server's call
// queues are `server_lag` behind (zero when the rule does not apply).
absl::Duration ServerLagAllowance(absl::Duration server_lag, const FailureDetectorOptions& options);

// Rule 4b's record of the server's call-queue lag (ShardServer reads it every
// tick). A member's timeout is extended by the worst lag read since its last
// beat: a lag while it was silent may have held its answer or its next beat
// in a queue (a worker beats one interval after the answer to its last),
// but a lag that ended before its last beat was heard cannot have delayed
// anything since. So the extension is per member:
//   - on a saturated 100K-rank server 2.2 s behind right after a barrier,
//     every host whose silence began during the lag is held for it until the
//     lag's own readings say it is over plus a timeout (a scalar window of
//     the timeout alone dropped the reading while such silences still ran,
//     and declared 589 live hosts dead at once: docs/scale.md);
//   - a host that falls silent after the server caught up is judged by the
//     bare timeout, however far behind the server was before (a scalar
//     window of timeout + interval + lag held such a death 1.4-1.9 s past
//     the timeout after a 100K-rank rejoin).
// Readings of at most half an interval extend nothing and are not kept; the
// kept ones are dropped once older than timeout + isolation_grace (a member
// silent that long is dead however late the server was). Not thread-safe.
class ServerLag {
 public:
  explicit ServerLag(const FailureDetectorOptions& options) : options_(options) {}

  // The queues' lag read at `at` (readings come in time order).
  void Read(absl::Time at, absl::Duration lag);
  // Rule 4b's extension for a member whose last beat was at `last_beat`:
  // the worst reading taken at or after it, at most isolation_grace; zero
  // when none was over half an interval, or without a grace (rule 4b off).
  absl::Duration AllowanceSince(absl::Time last_beat) const;
  // Whether a member that beat after `last_beat` can be dead at `now` by a
  // silence over `timeout` + its allowance, given that one that beat at
  // `last_beat` is not: true only where a later member's allowance is
  // smaller (its silence began after a worse lag was over). Lets the
  // server's timer stop at the first member the lag holds.
  bool LaterMayBeDead(absl::Time last_beat, absl::Time now, absl::Duration timeout) const;
  // The last beat time up to which members share `last_beat`'s allowance
  // (the end of its step); InfiniteFuture when that allowance is zero.
  absl::Time StepEnd(absl::Time last_beat) const;
  // The worst lag kept (zero when none is over half an interval).
  absl::Duration Worst() const { return steps_.empty() ? absl::ZeroDuration() : steps_[0].second; }

 private:
  // The first step that ends at or after `last_beat`.
  std::vector<std::pair<absl::Time, absl::Duration>>::const_iterator StepOf(
      absl::Time last_beat) const;

  const FailureDetectorOptions options_;
  // Readings over half an interval, oldest first, capped at the grace.
  std::deque<std::pair<absl::Time, absl::Duration>> readings_;
  // The allowance by when a silence began: a member whose last beat was in
  // (steps_[i-1].first, steps_[i].first] gets steps_[i].second; after the
  // last step, zero. Times increasing, allowances strictly decreasing.
  std::vector<std::pair<absl::Time, absl::Duration>> steps_;
};

// A client re-opens a broken heartbeat stream within ~100 ms and beats at
// once (rule 1).
inline constexpr absl::Duration kReopenGrace = absl::Milliseconds(300);

// Rule 0's wait for a re-opened stream. A stream also closes while its member
// lives when the client's own keepalive gives up on a connection whose pings
// went unanswered for kClientKeepaliveTimeoutMs (a starved server host, or a
// starved client), and the client then reconnects on the channel's backoff
// (at most 1 s apart) before it beats again: seen at load 15 on 2 cores, a
// 300-ms wait declared such a member dead at step 0. Two seconds, or two
// intervals if longer, cover that reconnect; a killed member is declared
// dead about that long after the kill.
inline constexpr absl::Duration kClosedStreamReopenWait = absl::Seconds(2);

// Rule 0: a stream that closed less than this after the member's last beat
// was closed by the member's end (its process exited, or its connection was
// reset), not by a keepalive timeout: the server's keepalive closes a silent
// connection kServerKeepaliveTimeoutMs (5 s) after its last bytes at the
// earliest. The window is 1.5 heartbeat intervals (a beating member's last
// beat is at most one interval old), capped at half that timeout.
inline constexpr absl::Duration kAbruptCloseCap = absl::Milliseconds(kServerKeepaliveTimeoutMs / 2);

// What the server knows of one live member (alive, not left).
struct MemberSignals {
  absl::Time last_heartbeat;  // formation time until the first beat
  // When the stream of its latest beat closed; InfinitePast: not since it
  // formed (an older stream closing later does not count).
  absl::Time stream_closed = absl::InfinitePast();
  // How far behind the server's call queues were at worst since its last
  // beat, as rule 4b counts it (ServerLag::AllowanceSince: capped at the
  // grace, zero at or under half an interval or when not measured).
  absl::Duration server_lag = absl::ZeroDuration();
};

// What the server knows of the job's current, formed generation.
struct JobSignals {
  bool peer_failure_reported = false;
  // When a beating member last reported a larger collective_seq;
  // InfinitePast: not in this generation.
  absl::Time data_plane_advanced = absl::InfinitePast();
  // The members belong to the job's current generation (rule 0 judges only
  // those: members of an abandoned generation close their streams on purpose).
  bool formed = true;
  // The latest beat of any live member of the job, when the caller passes
  // only some of them (the silent ones, shard_server/membership/silence_order.h);
  // rule 4 takes the later of this and the members' own.
  absl::Time last_heard = absl::InfinitePast();
  // Workers of the job wait in joins the server holds for a generation
  // that has not formed (a re-join barrier, a wait for --min_world_size):
  // they reach it now, so the job is not silent as a whole and rule 4 (the
  // server's own isolation) does not apply; a silent member is judged as
  // usual. (A formed job's growers do not count: one held join says little
  // about every member's path.)
  bool joins_held = false;
};

enum class Verdict {
  kAlive,               // rule 2
  kSeenByPeers,         // rule 3
  kIsolationSuspected,  // rule 4
  kServerBehind,        // rule 4b
  kDead,                // rules 0, 1 and 5
};

struct MemberVerdict {
  Verdict verdict = Verdict::kAlive;
  // Why, for the log: the rule that decided, in words. Empty for kAlive.
  std::string why;
};

// One verdict per member of `members` (the job's live members, or any of
// them with the others' latest beat in `job.last_heard`), at `now`. A member
// left out that beat within the heartbeat timeout (within 1.5 intervals
// after a peer failure) and whose stream did not close since is kAlive.
std::vector<MemberVerdict> JudgeMembers(const std::vector<MemberSignals>& members,
                                        const JobSignals& job, absl::Time now,
                                        const FailureDetectorOptions& options);

}  // namespace zeroshard

#endif  // ZEROSHARD_SHARD_SERVER_MEMBERSHIP_FAILURE_DETECTOR_H_
