// The failure detector's rules (shard_server/membership/failure_detector.h), one case a
// row: heartbeat interval 1 s, timeout 3 s, isolation grace 60 s; times in
// seconds since the generation formed.
#include "shard_server/membership/failure_detector.h"

#include <deque>
#include <string>
#include <utility>
#include <vector>

#include "gtest/gtest.h"

namespace zeroshard {
namespace {

constexpr double kNever = -1e9;

struct Case {
  std::string name;
  std::vector<double> last_beats;     // per member, s
  std::vector<double> stream_closed;  // per member, s (kNever: open)
  bool peer_failure;
  double data_plane_advanced;  // s (kNever: not in this generation)
  double now;                  // s
  std::vector<Verdict> want;
  bool formed = true;  // the members belong to the job's current generation
};

absl::Time At(double s) {
  return s == kNever ? absl::InfinitePast() : absl::UnixEpoch() + absl::Seconds(s);
}

FailureDetectorOptions Options(absl::Duration grace = absl::Seconds(60)) {
  return {absl::Seconds(1), absl::Seconds(3), grace};
}

std::vector<Verdict> Judge(const Case& c, const FailureDetectorOptions& options) {
  std::vector<MemberSignals> members;
  for (size_t i = 0; i < c.last_beats.size(); ++i) {
    members.push_back({At(c.last_beats[i]), At(c.stream_closed[i])});
  }
  std::vector<Verdict> got;
  for (const MemberVerdict& v :
       JudgeMembers(members, {c.peer_failure, At(c.data_plane_advanced), c.formed}, At(c.now),
                    options)) {
    got.push_back(v.verdict);
  }
  return got;
}

constexpr Verdict kAlive = Verdict::kAlive;
constexpr Verdict kSeen = Verdict::kSeenByPeers;
constexpr Verdict kSuspect = Verdict::kIsolationSuspected;
constexpr Verdict kDead = Verdict::kDead;

TEST(FailureDetectorTest, EachRuleDecidesItsCase) {
  const std::vector<Case> cases = {
      {"everyone beats",
       {9, 9.5, 9.8},
       {kNever, kNever, kNever},
       false,
       kNever,
       10,
       {kAlive, kAlive, kAlive}},
      {"one silent past the timeout while the others beat: dead",
       {5, 9.5, 9.8},
       {kNever, kNever, kNever},
       false,
       6,
       10,
       {kDead, kAlive, kAlive}},
      {"one silent, but the data plane advanced within the timeout: seen by its peers",
       {5, 9.5, 9.8},
       {kNever, kNever, kNever},
       false,
       9.7,
       10,
       {kSeen, kAlive, kAlive}},
      {"seen by peers ends one timeout after the data plane stopped",
       {5, 12.5, 12.8},
       {kNever, kNever, kNever},
       false,
       9.7,
       13,
       {kDead, kAlive, kAlive}},
      {"everyone silent: the server suspects itself",
       {5, 5.2, 5.1},
       {kNever, kNever, kNever},
       false,
       5,
       20,
       {kSuspect, kSuspect, kSuspect}},
      {"the whole job falls silent just after the data plane last advanced: one member past "
       "the timeout by rule 3's clock, the others silent 1.5 intervals and more: the server "
       "suspects itself (its cut from every host), it does not declare the first one dead",
       {5, 6.4, 6.45},
       {kNever, kNever, kNever},
       false,
       5.4,
       8.5,
       {kSuspect, kAlive, kAlive}},
      {"everyone silent past timeout + grace: dead",
       {5, 5.2, 5.1},
       {kNever, kNever, kNever},
       false,
       5,
       5.2 + 3 + 60.1,
       {kDead, kDead, kDead}},
      {"everyone silent, still within timeout + grace of the last beat heard",
       {5, 5.2, 5.1},
       {kNever, kNever, kNever},
       false,
       5,
       5.2 + 3 + 59.9,
       {kSuspect, kSuspect, kSuspect}},
      {"after a peer's failure: 1.5 intervals of silence is death",
       {8.4, 9.9, 9.9},
       {kNever, kNever, kNever},
       true,
       9.5,
       10,
       {kDead, kAlive, kAlive}},
      {"after a peer's failure: a closed stream past the reopen grace is death",
       {9.5, 9.9, 9.9},
       {9.6, kNever, kNever},
       true,
       kNever,
       10,
       {kDead, kAlive, kAlive}},
      {"after a peer's failure: a stream closed just now gets its reopen grace",
       {9.5, 9.9, 9.9},
       {9.8, kNever, kNever},
       true,
       kNever,
       10,
       {kAlive, kAlive, kAlive}},
      {"a stream closed by its end while beating, not re-opened for 2 s: dead, "
       "though the data plane advanced (a killed process)",
       {9.5, 11.5, 11.5},
       {9.6, kNever, kNever},
       false,
       11.5,
       11.7,
       {kDead, kAlive, kAlive}},
      {"a stream closed by its end gets 2 s to be re-opened (a live client whose keepalive "
       "dropped the connection reconnects on its backoff)",
       {9.5, 11.0, 11.0},
       {9.6, kNever, kNever},
       false,
       11.0,
       11.5,
       {kAlive, kAlive, kAlive}},
      {"a stream closed by its end gets its time to be re-opened",
       {9.5, 9.9, 9.9},
       {9.6, kNever, kNever},
       false,
       9.9,
       10.5,
       {kAlive, kAlive, kAlive}},
      {"a stream closed and re-opened (a later beat) is alive",
       {10.65, 10.6, 10.6},
       {9.6, kNever, kNever},
       false,
       10.6,
       10.7,
       {kAlive, kAlive, kAlive}},
      {"a stream closed by a keepalive timeout, seconds after the last beat, is silence: "
       "seen by its peers",
       {5, 11.5, 11.8},
       {10.5, kNever, kNever},
       false,
       11.8,
       12,
       {kSeen, kAlive, kAlive}},
      {"members of an abandoned generation close their streams on purpose",
       {9.5, 9.9},
       {9.6, kNever},
       false,
       kNever,
       10.7,
       {kAlive, kAlive},
       /*formed=*/false},
      {"after a peer's failure the data plane vouches for nobody",
       {5, 9.9, 9.9},
       {kNever, kNever, kNever},
       true,
       9.9,
       10,
       {kDead, kAlive, kAlive}},
  };
  for (const Case& c : cases) {
    EXPECT_EQ(Judge(c, Options()), c.want) << c.name;
  }
}

TEST(FailureDetectorTest, WithoutAGraceEveryoneSilentIsDeadAtTheTimeout) {
  const Case c{"", {5, 5.2}, {kNever, kNever}, false, kNever, 8.3, {}};
  EXPECT_EQ(Judge(c, Options(absl::ZeroDuration())), (std::vector<Verdict>{kDead, kDead}));
}

// Workers waiting in joins the server holds reach it: the job is not silent
// as a whole, so no isolation is suspected (#51 item 7: isolation_suspected
// was logged while members had joined and waited); a silent member of the
// abandoned generation is judged by its own timeout.
TEST(FailureDetectorTest, JoinsHeldRuleOutTheServersIsolation) {
  const std::vector<MemberSignals> silent = {{At(5), At(kNever)}, {At(5.1), At(kNever)}};
  JobSignals job{false, At(kNever), /*formed=*/false};
  std::vector<MemberVerdict> v = JudgeMembers(silent, job, At(9), Options());
  ASSERT_EQ(v.size(), 2u);
  EXPECT_EQ(v[0].verdict, kSuspect) << "without held joins, rule 4 as before";
  job.joins_held = true;
  v = JudgeMembers(silent, job, At(9), Options());
  ASSERT_EQ(v.size(), 2u);
  EXPECT_EQ(v[0].verdict, kDead) << v[0].why;
  EXPECT_EQ(v[1].verdict, kDead) << v[1].why;
  // Within the timeout they are alive either way.
  v = JudgeMembers(silent, job, At(7), Options());
  EXPECT_EQ(v[0].verdict, kAlive);
}

TEST(FailureDetectorTest, VerdictsOtherThanAliveSayWhy) {
  std::vector<MemberVerdict> v = JudgeMembers({{At(5), At(kNever)}, {At(5.1), At(kNever)}},
                                              {false, At(kNever)}, At(20), Options());
  ASSERT_EQ(v.size(), 2u);
  EXPECT_NE(v[0].why.find("--isolation_grace=1m"), std::string::npos) << v[0].why;
}

// Rule 4b: the server's own queues behind by more than half an interval
// extend the timeout by that lag (its beats may have waited in them), by at
// most the grace; not rule 0 or 1.
TEST(FailureDetectorTest, AServerBehindItsQueuesHoldsDeathsByTimeoutUpToTheGrace) {
  auto judge = [&](double lag_s, double now, bool peer_failure = false) {
    const std::vector<MemberSignals> members = {
        {At(5), At(kNever), absl::Seconds(lag_s)},    // silent 5 s
        {At(9.5), At(kNever), absl::Seconds(lag_s)},  // beating
        {At(5), At(6), absl::Seconds(lag_s)},         // its stream closed by its end: rule 0
    };
    JobSignals job{peer_failure, At(kNever)};
    job.last_heard = At(now - 0.5);  // others beat (rule 4 stays out)
    std::vector<Verdict> got;
    for (const MemberVerdict& v : JudgeMembers(members, job, At(now), Options())) {
      got.push_back(v.verdict);
    }
    return got;
  };
  constexpr Verdict kBehind = Verdict::kServerBehind;
  // Silent 5 s: the 3-s timeout extended by the lag.
  EXPECT_EQ(judge(2.5, 10), (std::vector<Verdict>{kBehind, kAlive, kDead}));
  EXPECT_EQ(judge(1.5, 10), (std::vector<Verdict>{kDead, kAlive, kDead}));  // 3 + 1.5 < 5
  EXPECT_EQ(judge(0.4, 8.2), (std::vector<Verdict>{kDead, kAlive, kDead}));  // under half an interval
  EXPECT_EQ(judge(0, 10), (std::vector<Verdict>{kDead, kAlive, kDead}));
  // Extended by at most the grace (60 s): silent 64 s is dead however late.
  EXPECT_EQ(judge(30, 37.9)[0], kBehind);
  EXPECT_EQ(judge(300, 69)[0], kDead);
  // After a peer's failure the data plane already stopped: rule 1 first.
  EXPECT_EQ(judge(2.5, 10, /*peer_failure=*/true)[0], kDead);
  // Without a grace rule 4b is off, as rule 4 is.
  const MemberSignals silent{At(5), At(kNever), absl::Seconds(5)};
  JobSignals job{false, At(kNever)};
  EXPECT_EQ(JudgeMembers({silent}, job, At(10), Options(absl::ZeroDuration()))[0].verdict, kDead);
  std::vector<MemberVerdict> why = JudgeMembers({silent}, job, At(10), Options());
  EXPECT_NE(why[0].why.find("5000 ms behind since its last beat"), std::string::npos) << why[0].why;
}

// Rule 4b's allowance is the worst lag read since the member's last beat:
// a lag during its silence may have held its answer or next beat; a lag
// that was over before its last beat was heard delayed nothing since.
TEST(FailureDetectorTest, TheLagAllowanceIsTheWorstReadSinceTheMembersLastBeat) {
  ServerLag lag(Options());
  auto since = [&](double last_beat) {
    return absl::ToDoubleSeconds(lag.AllowanceSince(At(last_beat)));
  };
  EXPECT_EQ(since(0), 0);
  lag.Read(At(1), absl::Seconds(0.2));  // under half an interval: nothing
  EXPECT_EQ(since(0), 0);
  EXPECT_EQ(lag.Worst(), absl::ZeroDuration());
  lag.Read(At(2), absl::Seconds(2.2));  // the queues 2.2 s behind 2 s after formation
  lag.Read(At(2.05), absl::Seconds(1.5));
  lag.Read(At(2.10), absl::Seconds(0.8));
  lag.Read(At(2.15), absl::Seconds(0.1));  // caught up
  EXPECT_DOUBLE_EQ(since(0), 2.2);
  EXPECT_DOUBLE_EQ(since(2), 2.2);     // a reading at the beat's own time counts
  EXPECT_DOUBLE_EQ(since(2.01), 1.5);  // silent after the worst reading
  EXPECT_DOUBLE_EQ(since(2.06), 0.8);
  EXPECT_DOUBLE_EQ(since(2.11), 0);    // silent after the lag was over: the bare timeout
  EXPECT_DOUBLE_EQ(since(9), 0);
  EXPECT_EQ(lag.Worst(), absl::Seconds(2.2));
  // Readings are capped at the grace and kept for timeout + grace (63 s).
  lag.Read(At(3), absl::Seconds(100));
  EXPECT_DOUBLE_EQ(since(2.5), 60);
  lag.Read(At(65.5), absl::ZeroDuration());  // 2.x is 63.4 s old: dropped; 3 is not
  EXPECT_DOUBLE_EQ(since(0), 60);
  lag.Read(At(66.5), absl::ZeroDuration());
  EXPECT_DOUBLE_EQ(since(0), 0);
  EXPECT_EQ(lag.Worst(), absl::ZeroDuration());
  // Without a grace rule 4b is off: nothing is kept.
  ServerLag off(Options(absl::ZeroDuration()));
  off.Read(At(1), absl::Seconds(5));
  EXPECT_EQ(off.AllowanceSince(At(0)), absl::ZeroDuration());
}

// The server's timer walks the members from the longest silent and stops at
// the first one rule 4b holds, unless a later one may be dead by a smaller
// allowance (LaterMayBeDead); StepEnd says how far that answer holds.
TEST(FailureDetectorTest, LaterMembersMayBeDeadOnlyWhereTheirAllowanceIsSmaller) {
  ServerLag lag(Options());
  lag.Read(At(2), absl::Seconds(2));  // steps: up to 2 -> 2 s
  lag.Read(At(4), absl::Seconds(1));  // (2, 4] -> 1 s; after 4: none
  const absl::Duration timeout = absl::Seconds(3);
  EXPECT_EQ(lag.StepEnd(At(1)), At(2));
  EXPECT_EQ(lag.StepEnd(At(3)), At(4));
  EXPECT_EQ(lag.StepEnd(At(5)), absl::InfiniteFuture());
  // At 5.9: one silent since 1 is held (4.9 <= 3 + 2). A member in (2, 4]
  // is silent < 3.9 <= 3 + 1: held; after 4, < 1.9: alive. Stop.
  EXPECT_FALSE(lag.LaterMayBeDead(At(1), At(5.9), timeout));
  // At 6.1 one silent since just after 2 (4.1 s) may be past 3 + 1; one in
  // (2, 4] held itself has only members after 4 behind it (< 2.1 s).
  EXPECT_TRUE(lag.LaterMayBeDead(At(1), At(6.1), timeout));
  EXPECT_FALSE(lag.LaterMayBeDead(At(3), At(6.1), timeout));
  // At 7.2 one silent since just after 4 (3.2 s) is past the bare timeout.
  EXPECT_TRUE(lag.LaterMayBeDead(At(3), At(7.2), timeout));

  // The case rule 4b was written for, from a 100K-rank run's log: a host
  // whose clock started at 2 s, while the server was 2.2 s behind, is held
  // until 3 + 2.2 s of silence, then dead; one that fell silent at 2.2 s,
  // after the lag was over, is dead at 3 s.
  ServerLag barrier(Options());
  barrier.Read(At(2), absl::Seconds(2.2));
  barrier.Read(At(2.1), absl::ZeroDuration());
  auto judge = [&](double last_beat, double now) {
    JobSignals job{false, At(kNever)};
    job.last_heard = At(now - 0.5);
    return JudgeMembers({{At(last_beat), At(kNever), barrier.AllowanceSince(At(last_beat))}}, job,
                        At(now), Options())[0]
        .verdict;
  };
  EXPECT_EQ(judge(2, 5.05), Verdict::kServerBehind);
  EXPECT_EQ(judge(2, 7.1), Verdict::kServerBehind);
  EXPECT_EQ(judge(2, 7.3), Verdict::kDead);
  EXPECT_EQ(judge(2.2, 5.25), Verdict::kDead);
}

}  // namespace
}  // namespace zeroshard
