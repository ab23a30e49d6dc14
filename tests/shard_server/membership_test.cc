// Membership: the join barrier, refusals, fencing, failure detection, leave
// and persistence (and changes that cannot be saved), driven directly with a
// FakeClock.
#include "shard_server/membership/membership.h"

#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gtest/gtest.h"
#include "shard_server/state/state_store.h"
#include "tests/testing/process.h"
#include "tests/testing/state_faults.h"

namespace zeroshard {
namespace {

using JoinResult = std::optional<absl::StatusOr<v1::JoinResponse>>;

class MembershipTest : public ::testing::Test {
 protected:
  MembershipTest() : log_([this](const std::string& line) { lines_.push_back(line); }) {
    options_.heartbeat_timeout = absl::Seconds(3);
    options_.join_timeout = absl::Seconds(60);
    options_.max_world_size = 1024;
    membership_ = std::make_unique<Membership>(&clock_, &log_, nullptr, options_);
  }

  v1::JoinRequest Request(const std::string& job, int world, const std::string& worker) {
    v1::JoinRequest r;
    r.set_job_id(job);
    r.set_world_size(world);
    r.set_worker_id(worker);
    r.set_host("host-" + worker);
    return r;
  }

  // Starts a join; the result lands in *out when answered.
  void Join(const std::string& job, int world, const std::string& worker, JoinResult* out) {
    membership_->Join(Request(job, world, worker), clock_.Now() + absl::Hours(1),
                      [out](absl::StatusOr<v1::JoinResponse> r) { *out = std::move(r); });
  }

  // Joins W workers "w0".."w{W-1}" and returns their responses by rank.
  std::vector<v1::JoinResponse> Form(
      const std::string& job, int world,
      Membership::ClockStart clock = Membership::ClockStart::kAtFormation) {
    std::vector<JoinResult> results(world);
    for (int i = 0; i < world; ++i) {
      JoinResult* out = &results[i];
      membership_->Join(Request(job, world, absl::StrCat("w", i)), clock_.Now() + absl::Hours(1),
                        [out](absl::StatusOr<v1::JoinResponse> r) { *out = std::move(r); }, clock);
    }
    std::vector<v1::JoinResponse> by_rank(world);
    for (auto& r : results) {
      EXPECT_TRUE(r.has_value() && r->ok());
      by_rank[(*r)->rank()] = **r;
    }
    return by_rank;
  }

  v1::MemberCredentials Credentials(const std::string& job, const v1::JoinResponse& r) {
    v1::MemberCredentials c;
    c.set_job_id(job);
    c.set_generation(r.generation());
    c.set_rank(r.rank());
    c.set_token(r.token());
    return c;
  }

  absl::StatusOr<v1::HeartbeatResponse> Beat(const v1::MemberCredentials& c) {
    v1::HeartbeatRequest h;
    *h.mutable_member() = c;
    return membership_->Heartbeat(h);
  }

  // Lines of `event` in the log so far.
  int Logged(const std::string& event) {
    int n = 0;
    for (const auto& line : lines_) n += line.find("event=" + event + " ") != std::string::npos;
    return n;
  }

  std::string StatusText(const std::string& job = "") {
    return membership_->Status(job).DebugString();
  }

  FakeClock clock_;
  std::vector<std::string> lines_;
  EventLog log_;
  MembershipOptions options_;
  std::unique_ptr<Membership> membership_;
};

TEST_F(MembershipTest, BarrierAnswersAllJoinsTogetherWithSortedRanks) {
  JoinResult c, a, b;
  Join("job", 3, "c", &c);
  Join("job", 3, "a", &a);
  EXPECT_FALSE(c.has_value());
  EXPECT_FALSE(a.has_value());
  Join("job", 3, "b", &b);
  ASSERT_TRUE(a && a->ok() && b && b->ok() && c && c->ok());
  EXPECT_EQ((*a)->rank(), 0);
  EXPECT_EQ((*b)->rank(), 1);
  EXPECT_EQ((*c)->rank(), 2);
  EXPECT_EQ((*a)->generation(), (*c)->generation());
  ASSERT_EQ((*b)->members_size(), 3);
  EXPECT_EQ((*b)->members(2).worker_id(), "c");
  EXPECT_EQ((*b)->members(2).host(), "host-c");
  EXPECT_NE((*a)->token(), (*b)->token());
  EXPECT_EQ(membership_->Status("job").jobs(0).state(), v1::RUNNING);
}

TEST_F(MembershipTest, RefusesEmptyJobIdWithoutChangingState) {
  JoinResult r;
  Join("", 2, "w0", &r);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r->status().message().find("job_id"), std::string::npos);
  EXPECT_EQ(membership_->Status("").jobs_size(), 0);
}

TEST_F(MembershipTest, RefusesEmptyWorkerId) {
  JoinResult r;
  Join("job", 2, "", &r);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r->status().message().find("worker_id"), std::string::npos);
  EXPECT_EQ(membership_->Status("").jobs_size(), 0);
}

TEST_F(MembershipTest, RefusesWorldSizeOutOfRange) {
  for (int world : {0, -3, 1025}) {
    JoinResult r;
    Join("job", world, "w0", &r);
    ASSERT_TRUE(r.has_value());
    EXPECT_EQ(r->status().code(), absl::StatusCode::kInvalidArgument) << world;
    EXPECT_NE(r->status().message().find(absl::StrCat("world_size ", world)), std::string::npos)
        << r->status();
  }
  EXPECT_EQ(membership_->Status("").jobs_size(), 0);
}

TEST_F(MembershipTest, RefusesPathUnsafeJobId) {
  JoinResult r;
  Join("../etc", 2, "w0", &r);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(membership_->Status("").jobs_size(), 0);
}

// A job id becomes a directory under the checkpoint root: one that can join
// can also checkpoint (at most 128 characters for both).
TEST_F(MembershipTest, RefusesAJobIdLongerThanACheckpointDirectoryMayBe) {
  JoinResult r;
  Join(std::string(129, 'j'), 1, "w0", &r);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->status().code(), absl::StatusCode::kInvalidArgument) << r->status();
  EXPECT_NE(r->status().message().find("at most 128"), std::string::npos) << r->status();
  EXPECT_EQ(membership_->Status("").jobs_size(), 0);
  Join(std::string(128, 'j'), 1, "w0", &r);
  ASSERT_TRUE(r.has_value());
  EXPECT_TRUE(r->ok()) << r->status();
}

TEST_F(MembershipTest, RefusesAHostThatIsNotPrintableAsciiWithoutSpaces) {
  for (const std::string host :
       {std::string("a\rb"), std::string("x event=member_dead"), std::string("\x1b[31mred"),
        std::string("nul\0byte", 8), std::string("h\xc3\xa9")}) {
    v1::JoinRequest request = Request("job", 1, "w0");
    request.set_host(host);
    JoinResult r;
    membership_->Join(request, clock_.Now() + absl::Hours(1),
                      [&r](absl::StatusOr<v1::JoinResponse> result) { r = std::move(result); });
    ASSERT_TRUE(r.has_value());
    EXPECT_EQ(r->status().code(), absl::StatusCode::kInvalidArgument) << r->status();
    EXPECT_NE(r->status().message().find("host"), std::string::npos) << r->status();
  }
  EXPECT_EQ(membership_->Status("").jobs_size(), 0);
  for (const std::string& line : lines_) EXPECT_EQ(line.find("member_dead"), std::string::npos);
}

TEST_F(MembershipTest, RefusesMismatchedWorldSize) {
  JoinResult first, second;
  Join("job", 3, "w0", &first);
  std::string before = StatusText();
  Join("job", 4, "w1", &second);
  ASSERT_TRUE(second.has_value());
  EXPECT_EQ(second->status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(second->status().message().find("world_size 4"), std::string::npos);
  EXPECT_NE(second->status().message().find("world_size 3"), std::string::npos);
  EXPECT_EQ(StatusText(), before);
  EXPECT_FALSE(first.has_value());
}

TEST_F(MembershipTest, RefusesJoinBeyondWorldSize) {
  Form("job", 2);
  std::string before = StatusText();
  JoinResult extra;
  Join("job", 2, "w9", &extra);
  ASSERT_TRUE(extra.has_value());
  EXPECT_EQ(extra->status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(extra->status().message().find("w9"), std::string::npos);
  EXPECT_EQ(StatusText(), before);
}

TEST_F(MembershipTest, RefusesWorkerIdThatIsALiveMember) {
  Form("job", 2);
  std::string before = StatusText();
  JoinResult again;
  Join("job", 2, "w1", &again);
  ASSERT_TRUE(again.has_value());
  EXPECT_EQ(again->status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_NE(again->status().message().find("live member"), std::string::npos);
  EXPECT_EQ(StatusText(), before);
}

TEST_F(MembershipTest, RefusesDuplicatePendingJoin) {
  JoinResult first, second;
  Join("job", 3, "w0", &first);
  std::string before = StatusText();
  Join("job", 3, "w0", &second);
  ASSERT_TRUE(second.has_value());
  EXPECT_EQ(second->status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(StatusText(), before);
  EXPECT_FALSE(first.has_value());
}

TEST_F(MembershipTest, FencesWrongTokenAndOldGeneration) {
  auto members = Form("job", 2);
  v1::MemberCredentials good = Credentials("job", members[0]);
  EXPECT_TRUE(membership_->CheckMember(good).ok());

  v1::MemberCredentials wrong = good;
  wrong.set_token("not-the-token");
  EXPECT_EQ(membership_->CheckMember(wrong).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(Beat(wrong).status().code(), absl::StatusCode::kFailedPrecondition);

  v1::MemberCredentials old = good;
  old.set_generation(good.generation() - 1);
  std::string before = StatusText();
  EXPECT_EQ(membership_->CheckMember(old).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(Beat(old).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(membership_->Leave(old).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(StatusText(), before);
}

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
    if (rank != kSilent) ASSERT_TRUE(Beat(Credentials("job", members[rank])).ok());
  }
  clock_.Advance(absl::Milliseconds(500));
  ASSERT_TRUE(Beat(Credentials("job", members[kSilent])).ok());
  for (int second = 0; second < 4; ++second) {
    clock_.Advance(absl::Seconds(1));
    for (int rank = kWorld - 1; rank >= 0; --rank) {
      if (rank != kSilent) ASSERT_TRUE(Beat(Credentials("job", members[rank])).ok());
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

// A node agent's message: the beats of its ranks recorded together, each
// answered in order, a refused one among them without disturbing the others.
TEST_F(MembershipTest, HeartbeatsOfOneAgentMessageAreEachAnsweredInOrder) {
  auto members = Form("job", 3);
  const int64_t generation = members[0].generation();
  std::vector<v1::HeartbeatRequest> requests(3);
  *requests[0].mutable_member() = Credentials("job", members[0]);
  *requests[1].mutable_member() = Credentials("job", members[2]);
  requests[1].mutable_member()->set_token("not its token");
  *requests[2].mutable_member() = Credentials("job", members[2]);
  requests[2].set_step(7);
  for (int second = 0; second < 5; ++second) {
    clock_.Advance(absl::Seconds(1));
    std::vector<absl::StatusOr<v1::HeartbeatResponse>> answers = membership_->Heartbeats(
        {{&requests[0], 11}, {&requests[1], 12}, {&requests[2], 13}});
    ASSERT_EQ(answers.size(), 3u);
    EXPECT_TRUE(answers[0].ok()) << answers[0].status();
    EXPECT_EQ(answers[1].status().code(), absl::StatusCode::kFailedPrecondition);
    ASSERT_TRUE(answers[2].ok()) << answers[2].status();
    EXPECT_EQ(answers[2]->generation(), answers[0]->generation());
    membership_->Tick();
  }
  // Ranks 0 and 2 beat through the batch; rank 1 never did and is dead.
  v1::JobStatus job = membership_->Status("job").jobs(0);
  EXPECT_EQ(job.generation(), generation + 1);
  EXPECT_TRUE(job.members(0).alive());
  EXPECT_FALSE(job.members(1).alive());
  EXPECT_TRUE(job.members(2).alive());
  EXPECT_EQ(job.members(2).step(), 7);
}

// RankBeat.same_member: the agent's message carries no credentials for a
// rank whose earlier beat on the stream did; the server passes the ones it
// kept (StreamBeat.member), and those are what is checked, not the empty
// ones in the request.
TEST_F(MembershipTest, ABeatsCredentialsMayComeApartFromItsRequest) {
  auto members = Form("job", 2);
  const v1::MemberCredentials kept = Credentials("job", members[1]);
  v1::MemberCredentials wrong = kept;
  wrong.set_token("not its token");
  v1::HeartbeatRequest request;  // no member
  request.set_step(9);
  clock_.Advance(absl::Seconds(1));
  std::vector<absl::StatusOr<v1::HeartbeatResponse>> answers =
      membership_->Heartbeats({{&request, 21, &kept}, {&request, 22, &wrong}});
  ASSERT_EQ(answers.size(), 2u);
  ASSERT_TRUE(answers[0].ok()) << answers[0].status();
  EXPECT_EQ(answers[0]->command(), v1::CONTINUE);
  EXPECT_EQ(answers[1].status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(membership_->Status("job").jobs(0).members(1).step(), 9);
}

// After a silence of the server's own (it was behind) every member's beat
// comes back at once: 64 heartbeat_resumed lines a job a second, the others
// counted in one heartbeats_resumed_unlisted line when the second is over.
TEST_F(MembershipTest, ResumedHeartbeatsAreListedUpTo64AJobASecondAndTheRestCounted) {
  constexpr int kWorld = 100;
  auto members = Form("job", kWorld);
  for (const auto& m : members) ASSERT_TRUE(Beat(Credentials("job", m)).ok());
  clock_.Advance(absl::Milliseconds(2500));  // over 2 intervals, under the timeout
  for (const auto& m : members) ASSERT_TRUE(Beat(Credentials("job", m)).ok());
  EXPECT_EQ(Logged("heartbeat_resumed"), 64);
  EXPECT_EQ(Logged("heartbeats_resumed_unlisted"), 0);  // the second is not over
  clock_.Advance(absl::Milliseconds(400));
  membership_->Tick();
  EXPECT_EQ(Logged("heartbeats_resumed_unlisted"), 0);
  clock_.Advance(absl::Milliseconds(700));
  membership_->Tick();
  ASSERT_EQ(Logged("heartbeats_resumed_unlisted"), 1);
  std::string summary;
  for (const auto& line : lines_) {
    if (line.find("event=heartbeats_resumed_unlisted ") != std::string::npos) summary = line;
  }
  EXPECT_NE(summary.find("members=36 "), std::string::npos) << summary;
  EXPECT_NE(summary.find("longest_silent_ms=2500"), std::string::npos) << summary;
  // A later silence starts a new second: listed again.
  for (const auto& m : members) ASSERT_TRUE(Beat(Credentials("job", m)).ok());
  clock_.Advance(absl::Milliseconds(2500));
  ASSERT_TRUE(Beat(Credentials("job", members[0])).ok());
  EXPECT_EQ(Logged("heartbeat_resumed"), 65);
  EXPECT_EQ(membership_->Status("job").jobs(0).state(), v1::RUNNING);
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
  beat(0, 200);  // t = 1: 100..199 fall silent now, after it
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
  for (const auto& line : lines_) logged |= line.find("event=answers_undelivered") != std::string::npos;
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
  for (int r = 0; r < 3; ++r) ASSERT_TRUE(BeatOn(*membership_, Credentials("job", members[r]), 10 + r).ok());
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

TEST_F(MembershipTest, SurvivorsRejoinTheNewGenerationAndKeepTheirRanks) {
  auto members = Form("job", 2);
  clock_.Advance(absl::Seconds(4));
  membership_->Tick();
  JoinResult a, b;
  Join("job", 2, "w1", &b);
  Join("job", 2, "w0", &a);
  ASSERT_TRUE(a && a->ok() && b && b->ok());
  EXPECT_EQ((*a)->rank(), 0);
  EXPECT_EQ((*b)->rank(), 1);
  EXPECT_EQ((*a)->generation(), members[0].generation() + 1);
  EXPECT_EQ(membership_->Status("job").jobs(0).state(), v1::RUNNING);
}

TEST_F(MembershipTest, CleanLeaveIsNotAFailureAndFinishesTheJob) {
  std::vector<std::pair<std::string, int64_t>> dropped;
  membership_->SetGenerationListener(
      [&](const std::string& job, int64_t g) { dropped.push_back({job, g}); });
  auto members = Form("job", 2);
  ASSERT_TRUE(membership_->Leave(Credentials("job", members[0])).ok());
  clock_.Advance(absl::Seconds(1));
  ASSERT_TRUE(Beat(Credentials("job", members[1])).ok());
  membership_->Tick();
  EXPECT_EQ(membership_->Status("job").jobs(0).state(), v1::RUNNING);
  EXPECT_TRUE(dropped.empty());
  ASSERT_TRUE(membership_->Leave(Credentials("job", members[1])).ok());
  EXPECT_EQ(membership_->Status("job").jobs(0).state(), v1::FINISHED);
  ASSERT_EQ(dropped.size(), 1u);
  // Long silence after leaving is not a death.
  clock_.Advance(absl::Seconds(60));
  membership_->Tick();
  EXPECT_EQ(membership_->Status("job").jobs(0).state(), v1::FINISHED);
}

TEST_F(MembershipTest, FinishedJobCanStartAgainWithAnotherWorldSize) {
  auto members = Form("job", 2);
  ASSERT_TRUE(membership_->Leave(Credentials("job", members[0])).ok());
  ASSERT_TRUE(membership_->Leave(Credentials("job", members[1])).ok());
  auto again = Form("job", 3);
  EXPECT_EQ(again[0].world_size(), 3);
  EXPECT_GT(again[0].generation(), members[0].generation());
}

TEST_F(MembershipTest, JoinTimesOutSayingHowManyJoined) {
  JoinResult a, b;
  Join("job", 4, "w0", &a);
  Join("job", 4, "w1", &b);
  clock_.Advance(absl::Seconds(61));
  membership_->Tick();
  ASSERT_TRUE(a.has_value());
  EXPECT_EQ(a->status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_NE(a->status().message().find("2 of 4"), std::string::npos) << a->status();
  ASSERT_TRUE(b.has_value());
  // The job never formed: it is gone with its last join, and its id is free
  // at once, for any world size.
  EXPECT_EQ(membership_->Status("job").jobs_size(), 0);
  Form("job", 2);
}

TEST_F(MembershipTest, ACancelledLastJoinFreesTheJobIdAtOnce) {
  JoinResult first;
  uint64_t id = membership_->Join(Request("squat", 8, "w0"), clock_.Now() + absl::Hours(1),
                                  [&](absl::StatusOr<v1::JoinResponse> r) { first = r; });
  membership_->CancelJoin(id);
  EXPECT_EQ(membership_->Status("squat").jobs_size(), 0);
  Form("squat", 1);  // another world size
}

TEST_F(MembershipTest, AJobWithoutLiveMembersIsForgottenAfterTheTtlAndNotBefore) {
  options_.job_ttl = absl::Hours(2);
  auto state = StateStore::Open(":memory:");
  ASSERT_TRUE(state.ok());
  membership_ = std::make_unique<Membership>(&clock_, &log_, state->get(), options_);
  std::vector<std::string> forgotten;
  membership_->SetForgetListener([&](const std::string& job) { forgotten.push_back(job); });
  std::vector<v1::JoinResponse> members = Form("done", 1);
  ASSERT_TRUE(membership_->Leave(Credentials("done", members[0])).ok());
  membership_->Tick();
  clock_.Advance(absl::Hours(2) - absl::Seconds(1));
  membership_->Tick();
  EXPECT_EQ(membership_->Status("done").jobs_size(), 1) << "forgotten before the ttl";
  clock_.Advance(absl::Seconds(2));
  membership_->Tick();
  EXPECT_EQ(membership_->Status("done").jobs_size(), 0);
  EXPECT_EQ(forgotten, std::vector<std::string>{"done"});
  auto stored = (*state)->LoadJobs();
  ASSERT_TRUE(stored.ok()) << stored.status();
  EXPECT_TRUE(stored->empty()) << "the state store still has the job";
  // A job used again starts above what its checkpoints recorded.
  membership_->SetGenerationFloor([](const std::string&) { return int64_t{7}; });
  EXPECT_EQ(Form("done", 2)[0].generation(), 8);
}

TEST_F(MembershipTest, ARunningJobIsNeverForgotten) {
  options_.job_ttl = absl::Seconds(1);
  membership_ = std::make_unique<Membership>(&clock_, &log_, nullptr, options_);
  std::vector<v1::JoinResponse> members = Form("busy", 1);
  for (int i = 0; i < 10; ++i) {
    clock_.Advance(absl::Seconds(1));
    ASSERT_TRUE(Beat(Credentials("busy", members[0])).ok());
    membership_->Tick();
  }
  EXPECT_EQ(membership_->Status("busy").jobs_size(), 1);
}

TEST_F(MembershipTest, JobsAndPendingJoinsAreBoundedNamingTheFlags) {
  options_.max_jobs = 2;
  options_.max_pending_joins = 3;
  membership_ = std::make_unique<Membership>(&clock_, &log_, nullptr, options_);
  JoinResult a, b, c;
  Join("a", 2, "w0", &a);
  Join("b", 2, "w0", &b);
  Join("c", 2, "w0", &c);  // a third job
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(c->status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(c->status().message().find("--max_jobs"), std::string::npos) << c->status();
  JoinResult e, f, g;
  options_.max_jobs = 100;
  membership_ = std::make_unique<Membership>(&clock_, &log_, nullptr, options_);
  Join("x", 4, "w0", &e);
  Join("x", 4, "w1", &f);
  Join("x", 4, "w2", &g);
  JoinResult h;
  Join("y", 4, "w0", &h);  // a fourth held join
  ASSERT_TRUE(h.has_value());
  EXPECT_EQ(h->status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(h->status().message().find("--max_pending_joins"), std::string::npos)
      << h->status();
  EXPECT_FALSE(e.has_value());
}

TEST_F(MembershipTest, CancelledJoinFreesTheWorkerId) {
  JoinResult first;
  uint64_t id = membership_->Join(Request("job", 2, "w0"), clock_.Now() + absl::Hours(1),
                                  [&](absl::StatusOr<v1::JoinResponse> r) { first = r; });
  membership_->CancelJoin(id);
  ASSERT_TRUE(first.has_value());
  EXPECT_EQ(first->status().code(), absl::StatusCode::kCancelled);
  Form("job", 2);  // w0 can join again
}

TEST_F(MembershipTest, RestoredServerKnowsItsJobsAndDeclaresSilentMembersDead) {
  std::string dir = testing::MakeTempDir("membership");
  int64_t generation = 0;
  {
    auto state = StateStore::Open(dir + "/state.db");
    ASSERT_TRUE(state.ok()) << state.status();
    Membership first(&clock_, &log_, state->get(), options_);
    JoinResult a, b;
    first.Join(Request("persisted", 2, "w0"), clock_.Now() + absl::Hours(1),
               [&](auto r) { a = r; });
    first.Join(Request("persisted", 2, "w1"), clock_.Now() + absl::Hours(1),
               [&](auto r) { b = r; });
    ASSERT_TRUE(a && a->ok());
    generation = (*a)->generation();
  }
  auto state = StateStore::Open(dir + "/state.db");
  ASSERT_TRUE(state.ok());
  Membership restored(&clock_, &log_, state->get(), options_);
  ASSERT_TRUE(restored.Restore().ok());
  v1::GetStatusResponse status = restored.Status("persisted");
  ASSERT_EQ(status.jobs_size(), 1);
  EXPECT_EQ(status.jobs(0).state(), v1::RUNNING);
  EXPECT_EQ(status.jobs(0).generation(), generation);
  ASSERT_EQ(status.jobs(0).members_size(), 2);
  EXPECT_EQ(status.jobs(0).members(1).worker_id(), "w1");
  // Past a heartbeat timeout but within restore_grace (10 s): every member
  // re-attaching at once after a restart or failover is not yet silent.
  clock_.Advance(absl::Seconds(4));
  restored.Tick();
  EXPECT_EQ(restored.Status("persisted").jobs(0).state(), v1::RUNNING);
  clock_.Advance(absl::Seconds(7));
  restored.Tick();
  EXPECT_EQ(restored.Status("persisted").jobs(0).state(), v1::DEGRADED);
}

v1::JoinRequest Elastic(v1::JoinRequest r, int min_world, int64_t grace_ms) {
  r.set_min_world_size(min_world);
  r.set_rejoin_grace_ms(grace_ms);
  return r;
}

// A job that shrank from 3 to 2 keeps 3 as its target across a server
// restart: its workers' re-joins (--world_size=3) are still accepted.
TEST_F(MembershipTest, ARestoredShrunkJobKeepsItsTargetWorldSize) {
  std::string dir = testing::MakeTempDir("membership");
  {
    auto state = StateStore::Open(dir + "/state.db");
    ASSERT_TRUE(state.ok()) << state.status();
    Membership first(&clock_, &log_, state->get(), options_);
    std::vector<JoinResult> joins(3);
    for (int i = 0; i < 3; ++i) {
      first.Join(Elastic(Request("el", 3, absl::StrCat("w", i)), 2, 1000),
                 clock_.Now() + absl::Hours(1), [&joins, i](auto r) { joins[i] = r; });
    }
    for (auto& r : joins) ASSERT_TRUE(r && r->ok());
    clock_.Advance(absl::Seconds(2));
    for (int i = 0; i < 2; ++i) {
      v1::HeartbeatRequest h;
      *h.mutable_member() = Credentials("el", **joins[i]);
      ASSERT_TRUE(first.Heartbeat(h).ok());
    }
    clock_.Advance(absl::Seconds(2));
    first.Tick();  // w2 dead
    std::vector<JoinResult> again(2);
    for (int i = 0; i < 2; ++i) {
      first.Join(Elastic(Request("el", 3, absl::StrCat("w", i)), 2, 1000),
                 clock_.Now() + absl::Hours(1), [&again, i](auto r) { again[i] = r; });
    }
    clock_.Advance(absl::Seconds(2));
    first.Tick();  // the grace is over: shrunk to 2
    for (auto& r : again) ASSERT_TRUE(r && r->ok() && (*r)->world_size() == 2);
  }
  auto state = StateStore::Open(dir + "/state.db");
  ASSERT_TRUE(state.ok());
  Membership restored(&clock_, &log_, state->get(), options_);
  ASSERT_TRUE(restored.Restore().ok());
  v1::JobStatus job = restored.Status("el").jobs(0);
  EXPECT_EQ(job.world_size(), 2);
  // The server was away: the members are declared dead after the restore
  // grace, and re-join with their --world_size=3: accepted (before, the
  // restored target was 2 and refused them as a mismatch), and formed again
  // at 2 after the grace.
  clock_.Advance(options_.restore_grace + absl::Seconds(1));
  restored.Tick();
  std::vector<JoinResult> rejoined(2);
  for (int i = 0; i < 2; ++i) {
    restored.Join(Elastic(Request("el", 3, absl::StrCat("w", i)), 2, 1000),
                  clock_.Now() + absl::Hours(1), [&rejoined, i](auto r) { rejoined[i] = r; });
  }
  clock_.Advance(absl::Seconds(2));
  restored.Tick();
  for (auto& r : rejoined) {
    ASSERT_TRUE(r && r->ok()) << (r ? r->status().ToString() : "no answer");
    EXPECT_EQ((*r)->world_size(), 2);
    EXPECT_EQ((*r)->target_world_size(), 3);
  }
}

TEST_F(MembershipTest, StatusShowsEachMembersLastStepAsItsHeartbeatReportedIt) {
  std::vector<v1::JoinResponse> members = Form("tele", 2);
  v1::HeartbeatRequest beat;
  *beat.mutable_member() = Credentials("tele", members[1]);
  beat.set_step(12);
  beat.mutable_last_step()->set_step_ms(140.5);
  beat.mutable_last_step()->set_items_per_second(3600);
  beat.mutable_last_step()->set_gather_wait_ms(31);
  beat.mutable_last_step()->set_reduce_wait_ms(4.5);
  ASSERT_TRUE(membership_->Heartbeat(beat).ok());
  // What a heartbeat costs on the wire with the telemetry (a 128-bit token,
  // a short job id): well under a hundred-odd bytes.
  EXPECT_LT(beat.ByteSizeLong(), 120u) << beat.ByteSizeLong();
  v1::JobStatus job = membership_->Status("tele").jobs(0);
  EXPECT_EQ(job.members(1).step(), 12);
  EXPECT_EQ(job.members(1).last_step().step_ms(), 140.5);
  EXPECT_EQ(job.members(1).last_step().items_per_second(), 3600);
  EXPECT_EQ(job.members(1).last_step().gather_wait_ms(), 31);
  EXPECT_EQ(job.members(1).last_step().reduce_wait_ms(), 4.5);
  EXPECT_EQ(job.members(0).last_step().step_ms(), 0) << "rank 0 has not reported a step";
}

// Each beat's telemetry replaces the last one whole (the server keeps the
// sub-messages' memory across beats, not their contents): a collective that
// ended is gone, a counter back to 0 reads 0, a unit name is not a mix.
TEST_F(MembershipTest, EachBeatsTelemetryReplacesTheLastOneWhole) {
  std::vector<v1::JoinResponse> members = Form("tele2", 1);
  v1::HeartbeatRequest beat;
  *beat.mutable_member() = Credentials("tele2", members[0]);
  v1::RankTelemetry* t = beat.mutable_telemetry();
  t->mutable_memory()->set_params(1000);
  t->mutable_memory()->set_grads(200);
  t->set_bytes_moved(77);
  t->mutable_in_progress()->set_op(v1::ALL_GATHER);
  t->mutable_in_progress()->set_unit("a.rather.long.unit.name.of.the.model.layers.11.mlp");
  t->mutable_in_progress()->set_seq(9);
  ASSERT_TRUE(membership_->Heartbeat(beat).ok());
  v1::RankTelemetry seen = membership_->Status("tele2").jobs(0).members(0).telemetry();
  EXPECT_EQ(seen.in_progress().unit(), "a.rather.long.unit.name.of.the.model.layers.11.mlp");
  EXPECT_EQ(seen.memory().grads(), 200);

  // Next beat: another, shorter unit; grads 0; bytes_moved 0.
  t->mutable_memory()->set_grads(0);
  t->set_bytes_moved(0);
  t->mutable_in_progress()->set_unit("head");
  t->mutable_in_progress()->set_op(v1::REDUCE_SCATTER);
  ASSERT_TRUE(membership_->Heartbeat(beat).ok());
  seen = membership_->Status("tele2").jobs(0).members(0).telemetry();
  EXPECT_EQ(seen.in_progress().unit(), "head");
  EXPECT_EQ(seen.in_progress().op(), v1::REDUCE_SCATTER);
  EXPECT_EQ(seen.in_progress().seq(), 9);
  EXPECT_EQ(seen.memory().params(), 1000);
  EXPECT_EQ(seen.memory().grads(), 0);
  EXPECT_EQ(seen.bytes_moved(), 0);

  // Next: no collective in flight, no memory report.
  t->clear_in_progress();
  t->clear_memory();
  t->set_bytes_moved(5);
  ASSERT_TRUE(membership_->Heartbeat(beat).ok());
  seen = membership_->Status("tele2").jobs(0).members(0).telemetry();
  EXPECT_FALSE(seen.has_in_progress()) << seen.DebugString();
  EXPECT_FALSE(seen.has_memory()) << seen.DebugString();
  EXPECT_EQ(seen.bytes_moved(), 5);

  // And back: both present again.
  t->mutable_in_progress()->set_unit("embed");
  t->mutable_memory()->set_cached(3);
  ASSERT_TRUE(membership_->Heartbeat(beat).ok());
  seen = membership_->Status("tele2").jobs(0).members(0).telemetry();
  EXPECT_EQ(seen.in_progress().unit(), "embed");
  EXPECT_EQ(seen.in_progress().seq(), 0);
  EXPECT_EQ(seen.memory().cached(), 3);
  EXPECT_EQ(seen.memory().params(), 0);
}

TEST_F(MembershipTest, StatusSaysWhyEachGenerationBeganAndCountsRejoins) {
  std::vector<v1::JoinResponse> members = Form("hist", 2);
  // w1 goes silent: declared dead, generation 2.
  clock_.Advance(absl::Seconds(2));
  ASSERT_TRUE(Beat(Credentials("hist", members[0])).ok());
  clock_.Advance(absl::Seconds(2));
  membership_->Tick();
  // Both join generation 2 (w1 restarted with its id).
  std::vector<v1::JoinResponse> again = Form("hist", 2);
  ASSERT_EQ(again[0].generation(), 2);
  v1::JobStatus job = membership_->Status("hist").jobs(0);
  ASSERT_EQ(job.history_size(), 2) << job.DebugString();
  EXPECT_EQ(job.history(0).generation(), 1);
  EXPECT_EQ(job.history(0).reason(), "job created");
  EXPECT_EQ(job.history(1).generation(), 2);
  EXPECT_EQ(job.history(1).reason(), "worker 'w1' (rank 1) stopped heartbeating");
  EXPECT_GT(job.history(1).unix_ms(), job.history(0).unix_ms());
  ASSERT_EQ(job.members_size(), 2);
  EXPECT_EQ(job.members(0).rejoins(), 1);
  EXPECT_EQ(job.members(1).rejoins(), 1);
}

// ---- Fault tolerance (#13): shrink, agreement, restarted processes ----

TEST_F(MembershipTest, ShrinksToTheSurvivorsAfterTheRejoinGrace) {
  std::vector<JoinResult> first(3);
  for (int i = 0; i < 3; ++i) {
    membership_->Join(Elastic(Request("el", 3, absl::StrCat("w", i)), 2, 5000),
                      clock_.Now() + absl::Hours(1), [&first, i](auto r) { first[i] = r; });
  }
  for (auto& r : first) ASSERT_TRUE(r && r->ok());
  // w2 goes silent and is declared dead: generation 2.
  clock_.Advance(absl::Seconds(2));
  for (int i = 0; i < 2; ++i) ASSERT_TRUE(Beat(Credentials("el", **first[i])).ok());
  clock_.Advance(absl::Seconds(2));
  membership_->Tick();
  std::vector<JoinResult> again(2);
  for (int i = 0; i < 2; ++i) {
    membership_->Join(Elastic(Request("el", 3, absl::StrCat("w", i)), 2, 5000),
                      clock_.Now() + absl::Hours(1), [&again, i](auto r) { again[i] = r; });
  }
  clock_.Advance(absl::Seconds(4));
  membership_->Tick();
  EXPECT_FALSE(again[0].has_value()) << "formed before the grace was over";
  clock_.Advance(absl::Seconds(1));
  membership_->Tick();
  for (auto& r : again) {
    ASSERT_TRUE(r && r->ok()) << (r ? r->status().ToString() : "no answer");
    EXPECT_EQ((*r)->world_size(), 2);
    EXPECT_EQ((*r)->target_world_size(), 3);
    EXPECT_EQ((*r)->generation(), 2);
  }
  EXPECT_EQ((*again[0])->rank(), 0);
  EXPECT_EQ((*again[1])->rank(), 1);
  v1::JobStatus job = membership_->Status("el").jobs(0);
  EXPECT_EQ(job.state(), v1::RUNNING);
  EXPECT_EQ(job.world_size(), 2);
  EXPECT_EQ(job.history(job.history_size() - 1).reason(),
            "shrunk from 3 to 2 workers after --rejoin_grace=5s");
}

// After a shrink, the lost worker id is admitted again, not refused: it waits
// while the members train, and the generation ends at the members' next
// committed snapshot; members and grower form the next one at the target
// world size. A further id is refused once the job is back at it.
TEST_F(MembershipTest, GrowsBackAtTheNextSnapshotAfterAShrink) {
  auto elastic_join = [&](const std::string& worker, JoinResult* out) {
    membership_->Join(Elastic(Request("el", 3, worker), 2, 1000), clock_.Now() + absl::Hours(1),
                      [out](auto r) { *out = r; });
  };
  std::vector<JoinResult> first(3);
  for (int i = 0; i < 3; ++i) elastic_join(absl::StrCat("w", i), &first[i]);
  for (auto& r : first) ASSERT_TRUE(r && r->ok());
  clock_.Advance(absl::Seconds(2));
  for (int i = 0; i < 2; ++i) ASSERT_TRUE(Beat(Credentials("el", **first[i])).ok());
  clock_.Advance(absl::Seconds(2));
  membership_->Tick();  // w2 dead: generation 2
  std::vector<JoinResult> shrunk(2);
  for (int i = 0; i < 2; ++i) elastic_join(absl::StrCat("w", i), &shrunk[i]);
  clock_.Advance(absl::Seconds(2));
  membership_->Tick();  // shrunk to 2
  for (auto& r : shrunk) ASSERT_TRUE(r && r->ok() && (*r)->world_size() == 2);

  auto beat = [&](int i, int64_t snapshot_step) {
    v1::HeartbeatRequest h;
    *h.mutable_member() = Credentials("el", **shrunk[i]);
    h.set_snapshot_step(snapshot_step);
    return membership_->Heartbeat(h);
  };
  for (int i = 0; i < 2; ++i) ASSERT_TRUE(beat(i, 20).ok());
  JoinResult grower;
  elastic_join("w2", &grower);
  EXPECT_FALSE(grower.has_value()) << grower->status();
  JoinResult another;
  elastic_join("w9", &another);
  ASSERT_TRUE(another.has_value());
  EXPECT_EQ(another->status().code(), absl::StatusCode::kResourceExhausted) << another->status();
  // No new snapshot yet: the members train on at W = 2.
  clock_.Advance(absl::Milliseconds(500));
  for (int i = 0; i < 2; ++i) ASSERT_TRUE(beat(i, 20).ok());
  membership_->Tick();
  EXPECT_EQ(membership_->Status("el").jobs(0).state(), v1::RUNNING);
  // One member committed step 30, the other not yet: still the same generation.
  ASSERT_EQ(beat(0, 30)->command(), v1::CONTINUE);
  membership_->Tick();
  EXPECT_EQ(membership_->Status("el").jobs(0).generation(), 2);
  ASSERT_EQ(beat(1, 30)->command(), v1::CONTINUE);
  membership_->Tick();
  v1::JobStatus job = membership_->Status("el").jobs(0);
  EXPECT_EQ(job.generation(), 3);
  EXPECT_EQ(job.history(job.history_size() - 1).reason(),
            "grow back from 2 to 3 of 3 workers ('w2') at the snapshot of step 30");
  EXPECT_EQ(beat(0, 30)->command(), v1::ABORT_GENERATION_CHANGED);
  std::vector<JoinResult> grown(2);
  for (int i = 0; i < 2; ++i) elastic_join(absl::StrCat("w", i), &grown[i]);
  ASSERT_TRUE(grower && grower->ok()) << (grower ? grower->status().ToString() : "no answer");
  EXPECT_EQ((*grower)->world_size(), 3);
  EXPECT_EQ((*grower)->rank(), 2);
  EXPECT_EQ((*grower)->generation(), 3);
  for (auto& r : grown) ASSERT_TRUE(r && r->ok() && (*r)->world_size() == 3);
  EXPECT_EQ(membership_->Status("el").jobs(0).world_size(), 3);
  JoinResult refused;
  elastic_join("w9", &refused);
  ASSERT_TRUE(refused.has_value());
  EXPECT_EQ(refused->status().code(), absl::StatusCode::kResourceExhausted);
}

TEST_F(MembershipTest, RecoveryThatCannotReachTheMinimumEndsWithAReason) {
  std::vector<JoinResult> first(3);
  for (int i = 0; i < 3; ++i) {
    membership_->Join(Elastic(Request("el", 3, absl::StrCat("w", i)), 3, 1000),
                      clock_.Now() + absl::Hours(1), [&first, i](auto r) { first[i] = r; });
  }
  clock_.Advance(absl::Seconds(2));
  for (int i = 0; i < 2; ++i) ASSERT_TRUE(Beat(Credentials("el", **first[i])).ok());
  clock_.Advance(absl::Seconds(2));
  membership_->Tick();
  JoinResult again;
  membership_->Join(Elastic(Request("el", 3, "w0"), 3, 1000), clock_.Now() + absl::Hours(1),
                    [&](auto r) { again = r; });
  clock_.Advance(absl::Seconds(2));
  membership_->Tick();
  ASSERT_TRUE(again.has_value());
  EXPECT_EQ(again->status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(again->status().message().find("only 1 of 3 workers re-joined"), std::string::npos)
      << again->status();
}

// W = 4, --min_world_size=3, --rejoin_grace=1s (heartbeat timeout 3 s): w3
// dies at t = 4, w0 and w1 re-join at once, w2 keeps beating but has not
// re-joined yet (a slow survivor).
class SlowSurvivorTest : public MembershipTest {
 protected:
  void SetUp() override {
    for (int i = 0; i < 4; ++i) {
      membership_->Join(Elastic(Request("el", 4, absl::StrCat("w", i)), 3, 1000),
                        clock_.Now() + absl::Hours(1), [this, i](auto r) { first_[i] = r; });
    }
    for (auto& r : first_) ASSERT_TRUE(r && r->ok());
    clock_.Advance(absl::Seconds(2));
    for (int i = 0; i < 3; ++i) ASSERT_TRUE(Beat(Credentials("el", **first_[i])).ok());
    clock_.Advance(absl::Seconds(2));
    membership_->Tick();  // w3 silent for 4 s: dead, generation 2
    ASSERT_EQ(membership_->Status("el").jobs(0).generation(), 2);
    for (int i = 0; i < 2; ++i) RejoinAs(i, &again_[i]);
  }

  void RejoinAs(int i, JoinResult* out) {
    membership_->Join(Elastic(Request("el", 4, absl::StrCat("w", i)), 3, 1000),
                      clock_.Now() + absl::Seconds(60), [out](auto r) { *out = r; });
  }

  // w2's beat on its old credentials (answered: abort, join again).
  void BeatW2() {
    absl::StatusOr<v1::HeartbeatResponse> r = Beat(Credentials("el", **first_[2]));
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->command(), v1::ABORT_GENERATION_CHANGED);
  }

  std::vector<JoinResult> first_ = std::vector<JoinResult>(4);
  std::vector<JoinResult> again_ = std::vector<JoinResult>(2);
};

// Past the grace with 2 of the 3 it needs, the server waits for w2, whose
// heartbeats still arrive, says so in status and once in the log, and forms
// W = 3 when w2 comes.
TEST_F(SlowSurvivorTest, PastTheGraceTheJobWaitsForALiveSurvivorAndFormsWhenItComes) {
  for (int s = 0; s < 6; ++s) {  // 1.5 s past the grace, then 2 s more
    clock_.Advance(absl::Milliseconds(500));
    BeatW2();
    membership_->Tick();
  }
  for (const JoinResult& r : again_) {
    EXPECT_FALSE(r.has_value()) << "answered while w2 was on its way: " << r->status();
  }
  v1::JobStatus job = membership_->Status("el").jobs(0);
  EXPECT_EQ(job.state(), v1::DEGRADED);
  ASSERT_EQ(job.waiting_for_size(), 1) << job.DebugString();
  EXPECT_EQ(job.waiting_for(0), "w2");
  EXPECT_NE(job.waiting().find("2 of 4 workers re-joined ('w0', 'w1') after --rejoin_grace=1s; "
                               "--min_world_size=3 needs 1 more: waiting for 'w2' (rank 2)"),
            std::string::npos)
      << job.waiting();
  EXPECT_EQ(Logged("recovery_waiting"), 1) << "logged once, not every tick";
  EXPECT_EQ(Logged("recovery_failed"), 0);

  JoinResult w2;
  RejoinAs(2, &w2);
  membership_->Tick();
  for (JoinResult* r : {&again_[0], &again_[1], &w2}) {
    ASSERT_TRUE(r->has_value() && (*r)->ok()) << (r->has_value() ? (*r)->status().ToString() : "");
    EXPECT_EQ((**r)->world_size(), 3);
    EXPECT_EQ((**r)->generation(), 2);
  }
  job = membership_->Status("el").jobs(0);
  EXPECT_EQ(job.state(), v1::RUNNING);
  EXPECT_EQ(job.waiting_for_size(), 0);
  EXPECT_EQ(job.waiting(), "");
  EXPECT_EQ(job.history(job.history_size() - 1).reason(),
            "shrunk from 4 to 3 workers after --rejoin_grace=1s and 2s more for 'w2'");
}

// The awaited survivor stops beating: once the failure detector declares it
// dead, too few can come, and every waiting re-join fails naming it.
TEST_F(SlowSurvivorTest, AnAwaitedSurvivorDeclaredDeadFailsTheRecoveryNamingIt) {
  clock_.Advance(absl::Milliseconds(1500));
  BeatW2();  // at t = 5.5: its last beat
  membership_->Tick();
  EXPECT_FALSE(again_[0].has_value());
  clock_.Advance(absl::Milliseconds(2900));  // silent 2.9 s of its 3-s timeout
  membership_->Tick();
  EXPECT_FALSE(again_[0].has_value()) << "failed before w2's timeout: " << again_[0]->status();
  clock_.Advance(absl::Milliseconds(200));
  membership_->Tick();
  for (const JoinResult& r : again_) {
    ASSERT_TRUE(r.has_value());
    EXPECT_EQ(r->status().code(), absl::StatusCode::kFailedPrecondition) << r->status();
    EXPECT_NE(r->status().message().find(
                  "job 'el' generation 2 cannot be formed: only 2 of 4 workers re-joined ('w0', "
                  "'w1') after --rejoin_grace=1s, and --min_world_size=3 needs 3; no other member "
                  "can come; 'w2' (rank 2) was declared dead, 'w3' (rank 3) was declared dead"),
              std::string::npos)
        << r->status();
  }
  EXPECT_EQ(Logged("recovery_failed"), 1);
  EXPECT_EQ(membership_->Status("el").jobs(0).waiting_for_size(), 0);
}

// A survivor that leaves cleanly instead of re-joining cannot come either.
TEST_F(SlowSurvivorTest, AnAwaitedSurvivorThatLeavesFailsTheRecoveryNamingIt) {
  clock_.Advance(absl::Milliseconds(1500));
  BeatW2();
  membership_->Tick();
  EXPECT_FALSE(again_[0].has_value());
  ASSERT_TRUE(membership_->Leave(Credentials("el", **first_[2])).ok());
  membership_->Tick();
  ASSERT_TRUE(again_[0].has_value());
  EXPECT_NE(again_[0]->status().message().find("'w2' (rank 2) left"), std::string::npos)
      << again_[0]->status();
}

TEST_F(MembershipTest, MembersMustAgreeOnMinWorldSizeAndGrace) {
  JoinResult a, b;
  membership_->Join(Elastic(Request("agree", 2, "w0"), 1, 30000), clock_.Now() + absl::Hours(1),
                    [&](auto r) { a = r; });
  std::string before = StatusText();
  membership_->Join(Elastic(Request("agree", 2, "w1"), 1, 10000), clock_.Now() + absl::Hours(1),
                    [&](auto r) { b = r; });
  ASSERT_TRUE(b.has_value());
  EXPECT_EQ(b->status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(b->status().message().find("--rejoin_grace=10s"), std::string::npos) << b->status();
  EXPECT_NE(b->status().message().find("--rejoin_grace=30s"), std::string::npos) << b->status();
  EXPECT_EQ(StatusText(), before);
  JoinResult bad;
  membership_->Join(Elastic(Request("agree", 2, "w2"), 3, 0), clock_.Now() + absl::Hours(1),
                    [&](auto r) { bad = r; });
  ASSERT_TRUE(bad.has_value());
  EXPECT_EQ(bad->status().code(), absl::StatusCode::kInvalidArgument);
}

// Two members of job "inc" (incarnations a0, a1), beating.
std::vector<v1::JoinResponse> FormWithIncarnations(Membership* membership, FakeClock* clock) {
  std::vector<std::optional<absl::StatusOr<v1::JoinResponse>>> first(2);
  for (int i = 0; i < 2; ++i) {
    v1::JoinRequest r;
    r.set_job_id("inc");
    r.set_world_size(2);
    r.set_worker_id(absl::StrCat("w", i));
    r.set_host("127.0.0.1");
    r.set_incarnation(absl::StrCat("a", i));
    membership->Join(r, clock->Now() + absl::Hours(1), [&first, i](auto x) { first[i] = x; });
  }
  std::vector<v1::JoinResponse> members;
  for (auto& r : first) {
    EXPECT_TRUE(r && r->ok());
    if (r && r->ok()) members.push_back(**r);
  }
  return members;
}

TEST_F(MembershipTest, JoinFromANewIncarnationCannotEvictABeatingMember) {
  std::vector<v1::JoinResponse> members = FormWithIncarnations(membership_.get(), &clock_);
  ASSERT_EQ(members.size(), 2u);
  // The ping-pong: a new process with w1's id, nine times, while w1 beats
  // every half interval.
  for (int i = 0; i < 9; ++i) {
    clock_.Advance(absl::Milliseconds(500));
    ASSERT_TRUE(Beat(Credentials("inc", members[1])).ok());
    ASSERT_TRUE(Beat(Credentials("inc", members[0])).ok());
    v1::JoinRequest fresh = Request("inc", 2, "w1");
    fresh.set_incarnation(absl::StrCat("evil", i));
    JoinResult refused;
    membership_->Join(fresh, clock_.Now() + absl::Hours(1), [&](auto x) { refused = x; });
    ASSERT_TRUE(refused.has_value());
    EXPECT_EQ(refused->status().code(), absl::StatusCode::kAlreadyExists) << refused->status();
  }
  v1::JobStatus job = membership_->Status("inc").jobs(0);
  EXPECT_EQ(job.generation(), 1);
  EXPECT_EQ(Beat(Credentials("inc", members[1]))->command(), v1::CONTINUE);
}

TEST_F(MembershipTest, JoinFromANewIncarnationReplacesAMemberWhoseStreamClosedAtOnce) {
  std::vector<v1::JoinResponse> members = FormWithIncarnations(membership_.get(), &clock_);
  ASSERT_EQ(members.size(), 2u);
  ASSERT_TRUE(Beat(Credentials("inc", members[1])).ok());
  // The same process again: refused as before.
  v1::JoinRequest same = Request("inc", 2, "w1");
  same.set_incarnation("a1");
  JoinResult dup;
  membership_->Join(same, clock_.Now() + absl::Hours(1), [&](auto x) { dup = x; });
  ASSERT_TRUE(dup.has_value());
  EXPECT_EQ(dup->status().code(), absl::StatusCode::kAlreadyExists);
  // w1 was killed: its stream closed. Generation 2 at once, the survivor is
  // told to abort.
  clock_.Advance(absl::Milliseconds(1));
  membership_->HeartbeatStreamClosed(Credentials("inc", members[1]));
  v1::JoinRequest fresh = Request("inc", 2, "w1");
  fresh.set_incarnation("b1");
  JoinResult replacement;
  membership_->Join(fresh, clock_.Now() + absl::Hours(1), [&](auto x) { replacement = x; });
  EXPECT_FALSE(replacement.has_value());
  absl::StatusOr<v1::HeartbeatResponse> beat = Beat(Credentials("inc", members[0]));
  ASSERT_TRUE(beat.ok());
  EXPECT_EQ(beat->command(), v1::ABORT_GENERATION_CHANGED);
  v1::JobStatus job = membership_->Status("inc").jobs(0);
  EXPECT_EQ(job.history(job.history_size() - 1).reason(), "worker 'w1' (rank 1) restarted");
  JoinResult survivor;
  v1::JoinRequest s0 = Request("inc", 2, "w0");
  s0.set_incarnation("a0");
  membership_->Join(s0, clock_.Now() + absl::Hours(1), [&](auto x) { survivor = x; });
  ASSERT_TRUE(survivor && survivor->ok());
  ASSERT_TRUE(replacement && replacement->ok());
  EXPECT_EQ((*replacement)->rank(), 1);
  EXPECT_EQ((*replacement)->generation(), 2);
}

TEST_F(MembershipTest, JoinFromANewIncarnationReplacesAMemberThatMissedABeat) {
  std::vector<v1::JoinResponse> members = FormWithIncarnations(membership_.get(), &clock_);
  ASSERT_EQ(members.size(), 2u);
  ASSERT_TRUE(Beat(Credentials("inc", members[1])).ok());
  clock_.Advance(absl::Milliseconds(1499));
  v1::JoinRequest fresh = Request("inc", 2, "w1");
  fresh.set_incarnation("b1");
  JoinResult early;
  membership_->Join(fresh, clock_.Now() + absl::Hours(1), [&](auto x) { early = x; });
  ASSERT_TRUE(early.has_value());
  EXPECT_EQ(early->status().code(), absl::StatusCode::kAlreadyExists);
  clock_.Advance(absl::Milliseconds(1));  // 1.5 heartbeat intervals (1 s): a beat missed
  JoinResult replacement;
  membership_->Join(fresh, clock_.Now() + absl::Hours(1), [&](auto x) { replacement = x; });
  EXPECT_FALSE(replacement.has_value());  // waits in generation 2
  EXPECT_EQ(membership_->Status("inc").jobs(0).generation(), 2);
}

TEST_F(MembershipTest, ItsOwnProcessJoiningAgainAfterClosingItsStreamStartsANewGeneration) {
  std::vector<v1::JoinResponse> members = FormWithIncarnations(membership_.get(), &clock_);
  ASSERT_EQ(members.size(), 2u);
  ASSERT_TRUE(Beat(Credentials("inc", members[1])).ok());
  clock_.Advance(absl::Milliseconds(1));
  membership_->HeartbeatStreamClosed(Credentials("inc", members[1]));
  v1::JoinRequest again = Request("inc", 2, "w1");
  again.set_incarnation("a1");
  JoinResult rejoined;
  membership_->Join(again, clock_.Now() + absl::Hours(1), [&](auto x) { rejoined = x; });
  EXPECT_FALSE(rejoined.has_value());
  v1::JobStatus job = membership_->Status("inc").jobs(0);
  EXPECT_EQ(job.generation(), 2);
  EXPECT_EQ(job.history(job.history_size() - 1).reason(),
            "worker 'w1' (rank 1) joined again (its setup failed)");
}

TEST_F(MembershipTest, StatusShowsTheSnapshotStepAndRecoveries) {
  std::vector<v1::JoinResponse> members = Form("rec", 2);
  for (int i = 0; i < 2; ++i) {
    v1::HeartbeatRequest h;
    *h.mutable_member() = Credentials("rec", members[i]);
    h.set_snapshot_step(i == 0 ? 40 : 30);
    if (i == 0) {
      h.mutable_recovery()->set_generation(1);
      h.mutable_recovery()->set_phase("training");
      h.mutable_recovery()->set_source("snapshot");
      h.mutable_recovery()->set_first_step_ms(900);
    }
    ASSERT_TRUE(membership_->Heartbeat(h).ok());
  }
  v1::JobStatus job = membership_->Status("rec").jobs(0);
  EXPECT_EQ(job.snapshot_step(), 30);
  ASSERT_EQ(job.recoveries_size(), 1);
  EXPECT_EQ(job.recoveries(0).source(), "snapshot");
  bool logged = false;
  for (const auto& line : lines_) logged = logged || line.find("recovery_training") != std::string::npos;
  EXPECT_TRUE(logged);
}

TEST_F(MembershipTest, RestoredMembersGetAFullTimeoutFromTheStartOfServing) {
  std::string dir = testing::MakeTempDir("membership");
  {
    auto state = StateStore::Open(dir + "/state.db");
    ASSERT_TRUE(state.ok()) << state.status();
    Membership first(&clock_, &log_, state->get(), options_);
    JoinResult a;
    first.Join(Request("slow-start", 1, "w0"), clock_.Now() + absl::Hours(1),
               [&](auto r) { a = r; });
    ASSERT_TRUE(a && a->ok());
  }
  auto state = StateStore::Open(dir + "/state.db");
  ASSERT_TRUE(state.ok());
  Membership restored(&clock_, &log_, state->get(), options_);
  ASSERT_TRUE(restored.Restore().ok());
  // The rest of the server's start takes longer than the restore grace.
  clock_.Advance(options_.restore_grace + absl::Seconds(2));
  restored.StartGrace();
  clock_.Advance(options_.restore_grace - absl::Seconds(1));
  restored.Tick();
  EXPECT_EQ(restored.Status("slow-start").jobs(0).state(), v1::RUNNING);
  clock_.Advance(absl::Seconds(2));
  restored.Tick();
  EXPECT_EQ(restored.Status("slow-start").jobs(0).state(), v1::DEGRADED);
}

// ---- Changes that cannot be saved ----

// A real state store whose job saves SQLite refuses on demand.
class MembershipSaveTest : public MembershipTest {
 protected:
  void SetUp() override {
    path_ = testing::MakeTempDir("membership_save") + "/state.db";
    auto state = StateStore::Open(path_);
    ASSERT_TRUE(state.ok()) << state.status();
    state_ = *std::move(state);
    membership_ = std::make_unique<Membership>(&clock_, &log_, state_.get(), options_);
  }
  void TearDown() override { membership_.reset(); }

  void RefuseSaves() { ASSERT_TRUE(testing::RefuseJobSaves(path_).ok()); }
  void AllowSaves() { ASSERT_TRUE(testing::AllowJobSaves(path_).ok()); }

  // The job as a restarted server would know it: what the disk holds.
  v1::JobStatus Saved(const std::string& job) {
    Membership restored(&clock_, &log_, state_.get(), options_);
    EXPECT_TRUE(restored.Restore().ok());
    v1::GetStatusResponse status = restored.Status(job);
    EXPECT_EQ(status.jobs_size(), 1);
    return status.jobs_size() == 1 ? status.jobs(0) : v1::JobStatus();
  }

  static bool NamesTheStoreError(const absl::Status& s) {
    return s.message().find(testing::kRefusedSaveError) != std::string::npos;
  }

  std::string path_;
  std::unique_ptr<StateStore> state_;
};

TEST_F(MembershipSaveTest, JobThatCannotBeSavedIsNotCreated) {
  RefuseSaves();
  JoinResult r;
  Join("job", 2, "w0", &r);
  ASSERT_TRUE(r.has_value());
  ASSERT_FALSE(r->ok());
  EXPECT_TRUE(NamesTheStoreError(r->status())) << r->status();
  EXPECT_NE(r->status().message().find("job 'job' could not be created"), std::string::npos);
  EXPECT_EQ(membership_->Status("").jobs_size(), 0);
  AllowSaves();
  EXPECT_EQ(Form("job", 2)[0].generation(), 1);
}

TEST_F(MembershipSaveTest, GenerationThatCannotBeSavedFailsEveryWaitingJoin) {
  JoinResult a, b;
  Join("job", 2, "w0", &a);
  RefuseSaves();
  Join("job", 2, "w1", &b);
  for (JoinResult* r : {&a, &b}) {
    ASSERT_TRUE(r->has_value());
    ASSERT_FALSE((*r)->ok());
    EXPECT_TRUE(NamesTheStoreError((*r)->status())) << (*r)->status();
    EXPECT_NE((*r)->status().message().find("job 'job' generation 1 could not be formed"),
              std::string::npos)
        << (*r)->status();
  }
  // Memory and disk agree: nobody joined generation 1 yet.
  v1::JobStatus job = membership_->Status("job").jobs(0);
  EXPECT_EQ(job.state(), v1::JOINING);
  EXPECT_EQ(job.joined(), 0);
  EXPECT_EQ(job.members_size(), 0);
  EXPECT_EQ(Saved("job").state(), v1::JOINING);
  EXPECT_EQ(Saved("job").members_size(), 0);

  AllowSaves();
  auto members = Form("job", 2);
  EXPECT_EQ(members[0].generation(), 1);
  EXPECT_EQ(Saved("job").members_size(), 2);
}

TEST_F(MembershipSaveTest, LeaveThatCannotBeSavedFailsAndChangesNothing) {
  std::vector<int64_t> dropped;
  membership_->SetGenerationListener(
      [&](const std::string&, int64_t generation) { dropped.push_back(generation); });
  auto members = Form("job", 1);
  v1::MemberCredentials member = Credentials("job", members[0]);
  RefuseSaves();
  absl::Status left = membership_->Leave(member);
  EXPECT_FALSE(left.ok());
  EXPECT_TRUE(NamesTheStoreError(left)) << left;
  EXPECT_NE(left.message().find("the leave of rank 0 of job 'job' could not be saved"),
            std::string::npos)
      << left;
  v1::JobStatus job = membership_->Status("job").jobs(0);
  EXPECT_EQ(job.state(), v1::RUNNING);
  EXPECT_FALSE(job.members(0).left());
  EXPECT_TRUE(job.members(0).alive());
  EXPECT_TRUE(membership_->CheckMember(member).ok());
  EXPECT_TRUE(dropped.empty());

  AllowSaves();
  ASSERT_TRUE(membership_->Leave(member).ok());
  EXPECT_EQ(membership_->Status("job").jobs(0).state(), v1::FINISHED);
  EXPECT_EQ(dropped.size(), 1u);
  EXPECT_EQ(Saved("job").state(), v1::FINISHED);
  EXPECT_TRUE(Saved("job").members(0).left());
}

TEST_F(MembershipSaveTest, DeathThatCannotBeSavedRefusesTheJobsCallsUntilTheTickSavesIt) {
  auto members = Form("job", 2);
  const int64_t generation = members[0].generation();
  v1::MemberCredentials survivor = Credentials("job", members[0]);
  RefuseSaves();
  clock_.Advance(absl::Seconds(2));
  ASSERT_TRUE(Beat(survivor).ok());
  clock_.Advance(absl::Seconds(2));
  membership_->Tick();  // rank 1 has been silent for 4 s

  // The death stands in memory; the disk still has the old generation.
  v1::JobStatus job = membership_->Status("job").jobs(0);
  EXPECT_EQ(job.state(), v1::DEGRADED);
  EXPECT_EQ(job.generation(), generation + 1);
  EXPECT_FALSE(job.members(1).alive());
  EXPECT_EQ(Saved("job").generation(), generation);
  EXPECT_EQ(Logged("state_store_error"), 1);
  // Until it is saved, the job's calls are refused with the store's error.
  absl::StatusOr<v1::HeartbeatResponse> beat = Beat(survivor);
  EXPECT_EQ(beat.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(NamesTheStoreError(beat.status())) << beat.status();
  JoinResult rejoin;
  Join("job", 2, "w0", &rejoin);
  ASSERT_TRUE(rejoin.has_value());
  EXPECT_EQ(rejoin->status().code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(NamesTheStoreError(rejoin->status())) << rejoin->status();
  membership_->Tick();
  EXPECT_EQ(Logged("state_store_error"), 1);  // retried, not logged again

  AllowSaves();
  membership_->Tick();
  EXPECT_EQ(Logged("state_saved"), 1);
  EXPECT_EQ(Saved("job").generation(), generation + 1);
  EXPECT_EQ(Saved("job").state(), v1::DEGRADED);
  EXPECT_FALSE(Saved("job").members(1).alive());
  beat = Beat(survivor);
  ASSERT_TRUE(beat.ok()) << beat.status();
  EXPECT_EQ(beat->command(), v1::ABORT_GENERATION_CHANGED);
}

TEST_F(MembershipSaveTest, UnsavedDeathIsSavedByTheJobsNextCall) {
  auto members = Form("job", 2);
  v1::MemberCredentials survivor = Credentials("job", members[0]);
  RefuseSaves();
  clock_.Advance(absl::Seconds(2));
  ASSERT_TRUE(Beat(survivor).ok());
  clock_.Advance(absl::Seconds(2));
  membership_->Tick();
  AllowSaves();
  absl::StatusOr<v1::HeartbeatResponse> beat = Beat(survivor);  // no Tick in between
  ASSERT_TRUE(beat.ok()) << beat.status();
  EXPECT_EQ(beat->command(), v1::ABORT_GENERATION_CHANGED);
  EXPECT_EQ(Saved("job").generation(), members[0].generation() + 1);
}

}  // namespace
}  // namespace zeroshard
