// Where a member is declared dead (shard_server/membership/deaths.cc, tick.cc): silence, the
// server's lag, agent joins' clocks, peer failures and closed streams.
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gtest/gtest.h"
#include "shard_server/membership/membership.h"
#include "tests/shard_server/membership/membership_fixture.h"

namespace zeroshard {
namespace {

TEST_F(MembershipTest, SilentMemberIsDeclaredDeadAndSurvivorsToldToAbort) {
  auto members = Form("job", 3);
  int64_t generation = members[0].generation();
  for (int i = 0; i < 5; ++i) {
    clock_.Advance(absl::Seconds(1));
    ASSERT_TRUE(Beat(Credentials("job", members[0])).ok());
    ASSERT_TRUE(Beat(Credentials("job", members[2])).ok());
    membership_->Tick();
    if (i < 2) {
      EXPECT_EQ(membership_->Status("job").jobs(0).state(), v1::RUNNING) << i;
    }
  }
  v1::JobStatus job = membership_->Status("job").jobs(0);
  EXPECT_EQ(job.state(), v1::DEGRADED);
  EXPECT_EQ(job.generation(), generation + 1);
  EXPECT_FALSE(job.members(1).alive());
  EXPECT_TRUE(job.members(0).alive());
  absl::StatusOr<v1::HeartbeatResponse> reply = Beat(Credentials("job", members[0]));
  ASSERT_TRUE(reply.ok()) << reply.status();
  EXPECT_EQ(reply->command(), v1::ABORT_GENERATION_CHANGED);
  EXPECT_EQ(reply->generation(), generation + 1);
  // The stale generation can no longer use the job's store.
  EXPECT_EQ(membership_->CheckMember(Credentials("job", members[0])).code(),
            absl::StatusCode::kFailedPrecondition);
  bool logged = false;
  for (const auto& line : lines_) logged |= line.find("event=member_dead") != std::string::npos;
  EXPECT_TRUE(logged);
}

// The tick looks only at the members that beat longest ago (the front of
// the job's silence order): a member that beat last and then fell silent
// must still come to the front and be found, and nobody else.
TEST_F(MembershipTest, TheOneMemberThatFallsSilentAmongManyIsTheOneDeclaredDead) {
  constexpr int kWorld = 64;
  constexpr int kSilent = 37;
  auto members = Form("job", kWorld);
  // Beats in an order unlike the ranks', the silent member last of all.
  for (int i = 0; i < kWorld; ++i) {
    const int rank = (i * 5 + 3) % kWorld;
    if (rank != kSilent) {
      ASSERT_TRUE(Beat(Credentials("job", members[rank])).ok());
    }
  }
  clock_.Advance(absl::Milliseconds(500));
  ASSERT_TRUE(Beat(Credentials("job", members[kSilent])).ok());
  for (int second = 0; second < 4; ++second) {
    clock_.Advance(absl::Seconds(1));
    for (int rank = kWorld - 1; rank >= 0; --rank) {
      if (rank != kSilent) {
        ASSERT_TRUE(Beat(Credentials("job", members[rank])).ok());
      }
    }
    membership_->Tick();
    if (second < 2) {
      ASSERT_EQ(membership_->Status("job").jobs(0).state(), v1::RUNNING) << second;
    }
  }
  v1::JobStatus job = membership_->Status("job").jobs(0);
  EXPECT_EQ(job.state(), v1::DEGRADED);
  for (int rank = 0; rank < kWorld; ++rank) {
    EXPECT_EQ(job.members(rank).alive(), rank != kSilent) << rank;
  }
}

// Rule 4b through Tick: while the server is 2 s behind, a member silent past
// the 3-s timeout is held up to 5 s; past that it is dead. Tick judges only
// the longest silent of the held ones (at 100K ranks it judged tens of
// thousands every 50 ms), which must not hold back those past the 5 s.
TEST_F(MembershipTest, WhileTheServerIsBehindMembersAreHeldForItsLagThenDeclaredDead) {
  options_.isolation_grace = absl::Seconds(90);
  membership_ = std::make_unique<Membership>(&clock_, &log_, nullptr, options_);
  constexpr int kWorld = 300;
  auto members = Form("job", kWorld);
  const int64_t generation = members[0].generation();
  auto beat = [&](int from, int to) {
    for (int r = from; r < to; ++r) ASSERT_TRUE(Beat(Credentials("job", members[r])).ok());
  };
  membership_->ReadServerLag(clock_.Now(), absl::Seconds(2));
  beat(0, kWorld);  // t = 0
  clock_.Advance(absl::Seconds(1));
  membership_->ReadServerLag(clock_.Now(), absl::Seconds(2));  // still behind
  beat(0, 100);  // 0..99 beat on; 100..199 fell silent at 0 s, 200..299 at 1 s
  beat(200, kWorld);
  for (int t = 2; t <= 4; ++t) {
    clock_.Advance(absl::Seconds(1));
    membership_->ReadServerLag(clock_.Now(), absl::Seconds(2));
    beat(0, 100);
    membership_->Tick();
    EXPECT_EQ(membership_->Status("job").jobs(0).generation(), generation) << t;
  }
  EXPECT_EQ(Logged("server_behind"), 1);
  EXPECT_EQ(Logged("member_dead"), 0);
  clock_.Advance(absl::Milliseconds(1100));  // t = 5.1: 100..199 past 5 s, 200..299 at 4.1
  beat(0, 100);
  membership_->Tick();
  v1::JobStatus job = membership_->Status("job").jobs(0);
  EXPECT_EQ(job.generation(), generation + 1);
  EXPECT_EQ(Logged("member_dead"), 100);
  for (int r = 0; r < kWorld; ++r) EXPECT_EQ(job.members(r).alive(), r < 100 || r >= 200) << r;
}

// Rule 4b extends a member's timeout by the lag read since its last beat,
// not by a lag that was over before it: members that fall silent after the
// server caught up are dead after the bare timeout, while those silent since
// the lag are still held for it (the timer walks past them to find the
// others).
TEST_F(MembershipTest, AMemberSilentSinceTheServerCaughtUpIsJudgedByTheBareTimeout) {
  options_.isolation_grace = absl::Seconds(90);
  membership_ = std::make_unique<Membership>(&clock_, &log_, nullptr, options_);
  constexpr int kWorld = 300;
  auto members = Form("job", kWorld);
  const int64_t generation = members[0].generation();
  auto beat = [&](int from, int to) {
    for (int r = from; r < to; ++r) ASSERT_TRUE(Beat(Credentials("job", members[r])).ok());
  };
  membership_->ReadServerLag(clock_.Now(), absl::Seconds(2));  // t = 0: 2 s behind
  beat(0, kWorld);  // 200..299 fall silent now, during the lag
  clock_.Advance(absl::Milliseconds(500));
  membership_->ReadServerLag(clock_.Now(), absl::ZeroDuration());  // caught up
  clock_.Advance(absl::Milliseconds(500));
  beat(0, 200);                   // t = 1: 100..199 fall silent now, after it
  for (int i = 0; i < 31; ++i) {  // to t = 4.1
    clock_.Advance(absl::Milliseconds(100));
    membership_->ReadServerLag(clock_.Now(), absl::ZeroDuration());
    if (i % 10 == 9) beat(0, 100);
    membership_->Tick();
  }
  v1::JobStatus job = membership_->Status("job").jobs(0);
  EXPECT_EQ(job.generation(), generation + 1);
  EXPECT_EQ(Logged("member_dead"), 100) << "100..199: silent 3.1 s, since after the lag";
  for (int r = 0; r < kWorld; ++r) EXPECT_EQ(job.members(r).alive(), r < 100 || r >= 200) << r;
  EXPECT_EQ(Logged("server_behind"), 1) << "200..299: silent 4.1 s, held for the 2-s lag";
  clock_.Advance(absl::Seconds(1));  // t = 5.1: 200..299 past 3 + 2 s
  membership_->ReadServerLag(clock_.Now(), absl::ZeroDuration());
  membership_->Tick();
  EXPECT_EQ(Logged("member_dead"), 200);
}

// After a death the survivors stop beating their old generation and wait in
// the next one's join barrier: the server holds their joins, so it is not
// the one cut off, and it must not log isolation_suspected for the silence
// of the generation they left (#51 item 7). Without those joins, the same
// silence is the server's own isolation, as before.
TEST_F(MembershipTest, SurvivorsWaitingInTheBarrierAreNoSignOfTheServersIsolation) {
  options_.isolation_grace = absl::Seconds(90);
  for (const bool rejoin : {false, true}) {
    SCOPED_TRACE(rejoin ? "survivors re-join" : "nobody re-joins");
    lines_.clear();
    membership_ = std::make_unique<Membership>(&clock_, &log_, nullptr, options_);
    auto members = Form("job", 3);
    for (int r = 0; r < 3; ++r) ASSERT_TRUE(Beat(Credentials("job", members[r])).ok());
    // Rank 2 falls silent; 0 and 1 beat on until it is declared dead.
    for (int i = 0; i < 32; ++i) {
      clock_.Advance(absl::Milliseconds(100));
      if (i % 10 == 9) {
        for (int r = 0; r < 2; ++r) (void)Beat(Credentials("job", members[r]));
      }
      membership_->Tick();
    }
    ASSERT_EQ(Logged("member_dead"), 1) << StatusText();
    JoinResult a, b;
    if (rejoin) {
      Join("job", 3, "w0", &a);
      Join("job", 3, "w1", &b);
      EXPECT_FALSE(a.has_value());  // held: the barrier waits for a third
    }
    // Their old generation's members now say nothing for 5 s.
    for (int i = 0; i < 50; ++i) {
      clock_.Advance(absl::Milliseconds(100));
      membership_->Tick();
    }
    EXPECT_EQ(Logged("isolation_suspected"), rejoin ? 0 : 1) << absl::StrJoin(lines_, "\n");
    membership_.reset();  // answers the held joins before `a` and `b` go
  }
}

TEST_F(MembershipTest, DeathIsDeclaredOnlyAfterTheTimeout) {
  auto members = Form("job", 2);
  clock_.Advance(absl::Milliseconds(2900));
  membership_->Tick();
  EXPECT_EQ(membership_->Status("job").jobs(0).state(), v1::RUNNING);
  clock_.Advance(absl::Milliseconds(200));
  membership_->Tick();
  EXPECT_EQ(membership_->Status("job").jobs(0).state(), v1::DEGRADED);
}

// A node agent's host join (ClockStart::kAtFirstBeat): a member's heartbeat
// timeout starts at its first beat, not when the generation formed, so
// answers that take longer than a timeout to reach every agent (100,000
// ranks on a busy machine) do not kill the generation on the way. A member
// whose answer could not be written has its clock started at once.
TEST_F(MembershipTest, AnAgentJoinsClockStartsAtItsFirstBeatNotAtFormation) {
  auto members = Form("job", 3, Membership::ClockStart::kAtFirstBeat);
  const int64_t generation = members[0].generation();
  clock_.Advance(absl::Seconds(10));  // the answers are still on their way
  membership_->Tick();
  ASSERT_EQ(membership_->Status("job").jobs(0).state(), v1::RUNNING);
  ASSERT_TRUE(Beat(Credentials("job", members[0])).ok());  // rank 0's only beat
  membership_->AnswersUndeliverable({{"job", generation, 2}});
  for (int i = 0; i < 29; ++i) {
    clock_.Advance(absl::Milliseconds(100));
    if (i % 10 == 0) {
      ASSERT_TRUE(Beat(Credentials("job", members[1])).ok());
    }
    membership_->Tick();
  }
  ASSERT_EQ(membership_->Status("job").jobs(0).state(), v1::RUNNING)
      << "2.9 s after their clocks started, ranks 0 and 2 are not dead yet";
  clock_.Advance(absl::Milliseconds(200));
  membership_->Tick();
  const v1::JobStatus job = membership_->Status("job").jobs(0);
  EXPECT_EQ(job.state(), v1::DEGRADED);
  EXPECT_EQ(job.generation(), generation + 1);
  EXPECT_FALSE(job.members(0).alive()) << "beat once, 3.1 s ago";
  EXPECT_TRUE(job.members(1).alive()) << "beating";
  EXPECT_FALSE(job.members(2).alive()) << "its answer could not be delivered 3.1 s ago";
}

// The same, with the answers still on the way: nobody is judged yet.
TEST_F(MembershipTest, AnAgentJoinThatHasNotBeatenIsNotJudgedBeforeTheDeliveryTimeout) {
  auto members = Form("job", 2, Membership::ClockStart::kAtFirstBeat);
  for (int second = 1; second <= 29; ++second) {
    clock_.Advance(absl::Seconds(1));
    membership_->Tick();
  }
  EXPECT_EQ(membership_->Status("job").jobs(0).state(), v1::RUNNING);
}

// The bound on a member that never beats: its clock starts
// answer_delivery_timeout after formation, so it is declared dead a
// heartbeat timeout after that.
TEST_F(MembershipTest, AnAgentJoinNeverDeliveredIsDeadAfterTheDeliveryTimeoutAndATimeout) {
  options_.answer_delivery_timeout = absl::Seconds(20);
  membership_ = std::make_unique<Membership>(&clock_, &log_, nullptr, options_);
  auto members = Form("job", 2, Membership::ClockStart::kAtFirstBeat);
  for (int second = 1; second <= 22; ++second) {
    clock_.Advance(absl::Seconds(1));
    ASSERT_TRUE(Beat(Credentials("job", members[0])).ok());
    membership_->Tick();
  }
  clock_.Advance(absl::Milliseconds(900));  // 22.9 s: 2.9 s of rank 1's clock
  ASSERT_TRUE(Beat(Credentials("job", members[0])).ok());
  membership_->Tick();
  ASSERT_EQ(membership_->Status("job").jobs(0).state(), v1::RUNNING);
  clock_.Advance(absl::Milliseconds(200));
  membership_->Tick();
  const v1::JobStatus job = membership_->Status("job").jobs(0);
  EXPECT_EQ(job.state(), v1::DEGRADED);
  EXPECT_TRUE(job.members(0).alive());
  EXPECT_FALSE(job.members(1).alive());
  bool logged = false;
  for (const auto& line : lines_)
    logged |= line.find("event=answers_undelivered") != std::string::npos;
  EXPECT_TRUE(logged);
}

// A survivor whose collective failed says so (peer_failure): a member whose
// heartbeat stream then closed is dead at once, without the timeout.
TEST_F(MembershipTest, APeerFailureAndAClosedStreamDeclareTheMemberDeadAtOnce) {
  auto members = Form("job", 3);
  clock_.Advance(absl::Milliseconds(200));
  for (int r = 0; r < 3; ++r) ASSERT_TRUE(Beat(Credentials("job", members[r])).ok());
  clock_.Advance(absl::Milliseconds(100));
  membership_->HeartbeatStreamClosed(Credentials("job", members[1]));  // kill -9
  v1::HeartbeatRequest report;
  *report.mutable_member() = Credentials("job", members[0]);
  report.set_peer_failure(true);
  ASSERT_TRUE(membership_->Heartbeat(report).ok());
  // Within the re-open grace a closed stream is not yet a death.
  clock_.Advance(absl::Milliseconds(200));
  membership_->Tick();
  EXPECT_EQ(membership_->Status("job").jobs(0).state(), v1::RUNNING);
  clock_.Advance(absl::Milliseconds(200));
  membership_->Tick();
  v1::JobStatus job = membership_->Status("job").jobs(0);
  EXPECT_EQ(job.state(), v1::DEGRADED);
  EXPECT_FALSE(job.members(1).alive());
  EXPECT_TRUE(job.members(2).alive());
}

// The report alone shortens the silence that counts as death to 1.5
// heartbeat intervals; members that keep beating stay alive.
TEST_F(MembershipTest, APeerFailureReportShortensTheSilenceThatCountsAsDeath) {
  auto members = Form("job", 3);
  v1::HeartbeatRequest report;
  *report.mutable_member() = Credentials("job", members[0]);
  report.set_peer_failure(true);
  for (int i = 0; i < 4; ++i) {
    clock_.Advance(absl::Milliseconds(400));
    ASSERT_TRUE(membership_->Heartbeat(report).ok());
    ASSERT_TRUE(Beat(Credentials("job", members[2])).ok());
    membership_->Tick();
    if (i < 3) {
      EXPECT_EQ(membership_->Status("job").jobs(0).state(), v1::RUNNING) << i;
    }
  }
  // 1.6 s of silence from rank 1 (interval 1 s), well inside the 3-s timeout.
  v1::JobStatus job = membership_->Status("job").jobs(0);
  EXPECT_EQ(job.state(), v1::DEGRADED);
  EXPECT_FALSE(job.members(1).alive());
  EXPECT_TRUE(job.members(0).alive());
  EXPECT_TRUE(job.members(2).alive());
}

absl::StatusOr<v1::HeartbeatResponse> BeatOn(Membership& m, const v1::MemberCredentials& c,
                                             uint64_t stream) {
  v1::HeartbeatRequest h;
  *h.mutable_member() = c;
  return m.Heartbeat(h, stream);
}

// Without a peer's report, the stream of a member's latest beat closing
// while it beats is its process going away (kill -9): dead once it was not
// re-opened within 2 s (a live client reconnects within that), before the
// 3-s timeout.
TEST_F(MembershipTest, AStreamClosedByItsEndIsDeathUnlessReopenedWithinTwoSeconds) {
  auto members = Form("job", 3);
  clock_.Advance(absl::Milliseconds(200));
  for (int r = 0; r < 3; ++r)
    ASSERT_TRUE(BeatOn(*membership_, Credentials("job", members[r]), 10 + r).ok());
  clock_.Advance(absl::Milliseconds(100));
  membership_->HeartbeatStreamClosed(Credentials("job", members[1]), 11);  // kill -9
  membership_->HeartbeatStreamClosed(Credentials("job", members[2]), 12);  // a reset connection
  clock_.Advance(absl::Milliseconds(200));
  ASSERT_TRUE(BeatOn(*membership_, Credentials("job", members[2]), 13).ok());  // re-opened
  clock_.Advance(absl::Milliseconds(1700));
  membership_->Tick();
  EXPECT_EQ(membership_->Status("job").jobs(0).state(), v1::RUNNING);  // 1.9 s after the close
  clock_.Advance(absl::Milliseconds(200));
  membership_->Tick();
  v1::JobStatus job = membership_->Status("job").jobs(0);
  EXPECT_EQ(job.state(), v1::DEGRADED);
  EXPECT_FALSE(job.members(1).alive());
  EXPECT_TRUE(job.members(2).alive());
}

// A connection the member already replaced closing late (its network was
// out; the old connection's RST or keepalive comes after the new stream's
// beats) says nothing: only the stream of its latest beat counts.
TEST_F(MembershipTest, AnOlderStreamClosingIsNoDeath) {
  auto members = Form("job", 2);
  clock_.Advance(absl::Milliseconds(200));
  ASSERT_TRUE(BeatOn(*membership_, Credentials("job", members[1]), 7).ok());
  ASSERT_TRUE(BeatOn(*membership_, Credentials("job", members[1]), 8).ok());  // a new stream
  ASSERT_TRUE(BeatOn(*membership_, Credentials("job", members[0]), 9).ok());
  clock_.Advance(absl::Milliseconds(100));
  membership_->HeartbeatStreamClosed(Credentials("job", members[1]), 7);
  clock_.Advance(absl::Milliseconds(1500));
  membership_->Tick();
  EXPECT_EQ(membership_->Status("job").jobs(0).state(), v1::RUNNING);
}

}  // namespace
}  // namespace zeroshard
