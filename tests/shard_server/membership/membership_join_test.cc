// Joins (shard_server/membership/joins.cc): refusals, bounds, cancellation, timeouts, and joins
// that replace a restarted process.
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "shard_server/membership/membership.h"
#include "tests/shard_server/membership/membership_fixture.h"

namespace zeroshard {
namespace {

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
  for (const std::string& host :
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
  EXPECT_NE(h->status().message().find("--max_pending_joins"), std::string::npos) << h->status();
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

}  // namespace
}  // namespace zeroshard
