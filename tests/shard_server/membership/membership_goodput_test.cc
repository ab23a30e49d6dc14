// Each job's goodput ledger as Membership feeds it (shard_server/membership/goodput.cc):
// beats carrying TimeLedgers on a FakeClock, a rank killed (its stream
// closed), the verdict, the re-formation, a finish and a restart, a restored
// server; JobStatus.goodput read as shardctl and /metrics read it.
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "shard_server/membership/membership.h"
#include "shard_server/state/state_store.h"
#include "tests/shard_server/membership/membership_fixture.h"
#include "tests/testing/process.h"

namespace zeroshard {
namespace {

// Error model: every time here is a whole number of milliseconds on the
// FakeClock, turned into double seconds and added up ~30 times, each value
// under 1e3 s: rounding stays under 30 x 1e3 x 2^-52 ~ 7e-12 s. 1e-9 s.
constexpr double kEps = 1e-9;

double Cause(const v1::Goodput& g, const std::string& cause) {
  if (cause == "productive") return g.productive_seconds();
  auto it = g.badput_seconds().find(cause);
  return it == g.badput_seconds().end() ? -1 : it->second;
}

double Sum(const v1::Goodput& g) {
  double sum = g.productive_seconds();
  for (const auto& [cause, seconds] : g.badput_seconds()) sum += seconds;
  return sum;
}

v1::TimeLedger Ledger(double startup, double productive) {
  v1::TimeLedger l;
  l.set_startup(startup);
  l.set_productive(productive);
  return l;
}

class GoodputTest : public MembershipTest {
 protected:
  absl::StatusOr<v1::HeartbeatResponse> BeatWith(Membership& m, const v1::MemberCredentials& c,
                                                 int64_t step, const v1::TimeLedger* time) {
    v1::HeartbeatRequest h;
    *h.mutable_member() = c;
    h.set_step(step);
    if (time != nullptr) *h.mutable_telemetry()->mutable_time() = *time;
    return m.Heartbeat(h, /*stream=*/c.rank() + 1);
  }
  v1::Goodput Goodput(Membership& m, const std::string& job) {
    v1::GetStatusResponse status = m.Status(job);
    EXPECT_EQ(status.jobs_size(), 1);
    return status.jobs_size() == 1 ? status.jobs(0).goodput() : v1::Goodput();
  }
  double Since(absl::Time t) { return absl::ToDoubleSeconds(clock_.Now() - t); }
};

// Rank 1 killed 5.25 s into the generation (its stream closes then), the
// verdict about 2 s later, the re-joins 1.5 s after it: detection from the
// close to the verdict, reforming from the verdict to the formation, the
// step in flight as lost work, every cause summing to the wall clock.
TEST_F(GoodputTest, AKilledRankIsDetectionReformingAndLostWork) {
  const absl::Time t0 = clock_.Now();
  JoinResult a, b;
  Join("gp", 2, "w0", &a);
  clock_.Advance(absl::Seconds(1));
  Join("gp", 2, "w1", &b);
  ASSERT_TRUE(a && a->ok() && b && b->ok());
  const v1::MemberCredentials c0 = Credentials("gp", **a), c1 = Credentials("gp", **b);
  v1::Goodput g = Goodput(*membership_, "gp");
  EXPECT_NEAR(Cause(g, "rendezvous"), 1, kEps);
  // 5 s of training, the ledger (startup 0.5 s, then productive) 0.3 s
  // behind the clock: the step in progress.
  v1::TimeLedger ledger;
  for (int i = 1; i <= 10; ++i) {
    clock_.Advance(absl::Milliseconds(500));
    ledger = Ledger(0.5, i * 0.5 - 0.8 > 0 ? i * 0.5 - 0.8 : 0);
    ASSERT_TRUE(BeatWith(*membership_, c0, 10, &ledger).ok());
    ASSERT_TRUE(BeatWith(*membership_, c1, 10, nullptr).ok());
  }
  g = Goodput(*membership_, "gp");
  EXPECT_NEAR(g.wall_seconds(), 6, kEps);
  EXPECT_NEAR(Cause(g, "in_flight"), 0.3, kEps);
  clock_.Advance(absl::Milliseconds(250));
  const absl::Time killed = clock_.Now();
  membership_->HeartbeatStreamClosed(c1, /*stream=*/2);
  absl::Time verdict = absl::InfiniteFuture();
  for (int i = 0; i < 100 && verdict == absl::InfiniteFuture(); ++i) {
    clock_.Advance(absl::Milliseconds(100));
    if (i % 5 == 4) BeatWith(*membership_, c0, 10, &ledger).IgnoreError();  // blocked, beating
    membership_->Tick();
    if (membership_->Status("gp").jobs(0).state() == v1::DEGRADED) verdict = clock_.Now();
  }
  ASSERT_NE(verdict, absl::InfiniteFuture());
  clock_.Advance(absl::Milliseconds(1500));
  JoinResult a2, b2;
  Join("gp", 2, "w0", &a2);
  v1::JoinRequest again = Request("gp", 2, "w1");
  again.set_steps_completed(12);  // it had got further than its last beat said
  membership_->Join(again, clock_.Now() + absl::Hours(1), [&b2](auto r) { b2 = std::move(r); });
  ASSERT_TRUE(a2 && a2->ok() && b2 && b2->ok());
  EXPECT_EQ((*a2)->steps_done(), 12);
  g = Goodput(*membership_, "gp");
  const double detection = absl::ToDoubleSeconds(verdict - killed);
  EXPECT_GT(detection, 0.5);
  EXPECT_NEAR(Cause(g, "detection"), detection, kEps);
  EXPECT_NEAR(Cause(g, "reforming"), 1.5, kEps);
  EXPECT_NEAR(Cause(g, "rendezvous"), 1, kEps);
  EXPECT_NEAR(g.productive_seconds(), 4.2, kEps);
  EXPECT_NEAR(Cause(g, "startup"), 0.5, kEps);
  // Running from 1 s to the kill at 6.25 s, 4.7 s of it reported.
  EXPECT_NEAR(Cause(g, "lost_work"), 5.25 - 4.7, kEps);
  EXPECT_NEAR(Cause(g, "in_flight"), 0, kEps);
  EXPECT_NEAR(g.wall_seconds(), Since(t0), kEps);
  EXPECT_NEAR(Sum(g), g.wall_seconds(), kEps);
  EXPECT_NEAR(g.goodput(), 4.2 / Since(t0), kEps);
}

// Every member left: what the last report did not cover is `other`, and the
// clock stops until the job is started again.
TEST_F(GoodputTest, TheClockStopsWhenTheJobFinishesAndGoesOnWhenItRestarts) {
  const absl::Time t0 = clock_.Now();
  std::vector<v1::JoinResponse> r = Form("fin", 2);
  clock_.Advance(absl::Seconds(10));
  v1::LeaveRequest leave0, leave1;
  leave0.set_has_final(true);
  leave0.set_final_step(20);
  *leave0.mutable_final_time() = Ledger(0.25, 9.5);
  *leave1.mutable_final_time() = Ledger(0.25, 9.0);
  ASSERT_TRUE(membership_->Leave(Credentials("fin", r[0]), &leave0).ok());
  clock_.Advance(absl::Milliseconds(200));
  ASSERT_TRUE(membership_->Leave(Credentials("fin", r[1]), &leave1).ok());
  ASSERT_EQ(membership_->Status("fin").jobs(0).state(), v1::FINISHED);
  clock_.Advance(absl::Seconds(100));
  membership_->Tick();
  v1::Goodput g = Goodput(*membership_, "fin");
  EXPECT_NEAR(g.wall_seconds(), 10.2, kEps);
  EXPECT_NEAR(g.productive_seconds(), 9.5, kEps);
  EXPECT_NEAR(Cause(g, "other"), 10.2 - 9.75, kEps);
  EXPECT_NEAR(Sum(g), 10.2, kEps);
  const absl::Time restart = clock_.Now();
  JoinResult a, b;
  Join("fin", 2, "w0", &a);
  clock_.Advance(absl::Seconds(2));
  Join("fin", 2, "w1", &b);
  ASSERT_TRUE(a && a->ok() && b && b->ok());
  EXPECT_EQ((*a)->steps_done(), 0);  // a new run: it trains its steps for the first time
  g = Goodput(*membership_, "fin");
  EXPECT_NEAR(g.wall_seconds(), 10.2 + Since(restart), kEps);
  EXPECT_NEAR(Cause(g, "rendezvous"), 2, kEps);
  EXPECT_LT(std::abs(Since(t0) - g.wall_seconds() - 100), kEps);  // the 100 s finished
}

// A generation ended with nobody dead (a member that left joins again): no
// detection; running to that verdict, what the reports did not cover as
// lost work, then reforming.
TEST_F(GoodputTest, AVerdictWithoutADeathHasNoDetection) {
  std::vector<v1::JoinResponse> r = Form("again", 2);
  clock_.Advance(absl::Seconds(4));
  v1::LeaveRequest leave;
  *leave.mutable_final_time() = Ledger(0.5, 3.25);
  ASSERT_TRUE(membership_->Leave(Credentials("again", r[1]), &leave).ok());
  clock_.Advance(absl::Seconds(2));
  JoinResult a, b;
  Join("again", 2, "w1", &b);  // the verdict: a new generation, DEGRADED
  ASSERT_EQ(membership_->Status("again").jobs(0).state(), v1::DEGRADED);
  clock_.Advance(absl::Seconds(1));
  Join("again", 2, "w0", &a);
  ASSERT_TRUE(a && a->ok() && b && b->ok());
  const v1::Goodput g = Goodput(*membership_, "again");
  EXPECT_NEAR(Cause(g, "detection"), 0, kEps);
  EXPECT_NEAR(g.productive_seconds(), 3.25, kEps);
  EXPECT_NEAR(Cause(g, "lost_work"), 6 - 3.75, kEps);
  EXPECT_NEAR(Cause(g, "reforming"), 1, kEps);
  EXPECT_NEAR(Sum(g), 7, kEps);
}

TEST_F(GoodputTest, ALedgerThatIsNotOneIsRefusedNamingItsField) {
  std::vector<v1::JoinResponse> r = Form("bad", 1);
  v1::TimeLedger negative = Ledger(0, -1);
  absl::StatusOr<v1::HeartbeatResponse> beat =
      BeatWith(*membership_, Credentials("bad", r[0]), 1, &negative);
  ASSERT_EQ(beat.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(beat.status().message().find("HeartbeatRequest.telemetry.time.productive is -1"),
            std::string::npos)
      << beat.status();
  v1::LeaveRequest leave;
  leave.mutable_final_time()->set_stall(std::nan(""));
  absl::Status left = membership_->Leave(Credentials("bad", r[0]), &leave);
  EXPECT_EQ(left.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(left.message().find("LeaveRequest.final_time.stall is nan"), std::string::npos) << left;
  v1::JoinRequest join = Request("bad2", 1, "w0");
  join.set_steps_completed(-3);
  JoinResult refused;
  membership_->Join(join, clock_.Now() + absl::Hours(1), [&](auto x) { refused = std::move(x); });
  ASSERT_TRUE(refused.has_value());
  EXPECT_EQ(refused->status().code(), absl::StatusCode::kInvalidArgument);
}

// A restarted server: the ledger it saved, and the running time while it was
// down covered again by the workers' cumulative ledgers; forgotten with the
// job.
TEST_F(GoodputTest, ARestartedServerKeepsTheLedgerAndForgetsItWithTheJob) {
  const std::string dir = testing::MakeTempDir("membership_goodput");
  options_.job_ttl = absl::Minutes(1);
  const absl::Time t0 = clock_.Now();
  {
    auto state = StateStore::Open(dir + "/state.db");
    ASSERT_TRUE(state.ok()) << state.status();
    Membership first(&clock_, &log_, state->get(), options_);
    JoinResult a, b;
    first.Join(Request("kept", 2, "w0"), clock_.Now() + absl::Hours(1), [&](auto r) { a = r; });
    clock_.Advance(absl::Seconds(3));
    first.Join(Request("kept", 2, "w1"), clock_.Now() + absl::Hours(1), [&](auto r) { b = r; });
    ASSERT_TRUE(a && a->ok() && b && b->ok());
    clock_.Advance(absl::Seconds(12));
    v1::TimeLedger ledger = Ledger(1, 10);
    ASSERT_TRUE(BeatWith(first, Credentials("kept", **a), 30, &ledger).ok());
    ASSERT_TRUE(BeatWith(first, Credentials("kept", **b), 30, nullptr).ok());
    first.Tick();  // saved: it changed, and the last save is 12 s old
  }
  clock_.Advance(absl::Seconds(20));  // the server is down; the job trains on
  auto state = StateStore::Open(dir + "/state.db");
  ASSERT_TRUE(state.ok()) << state.status();
  Membership second(&clock_, &log_, state->get(), options_);
  ASSERT_TRUE(second.Restore().ok());
  v1::Goodput g = Goodput(second, "kept");
  EXPECT_NEAR(g.wall_seconds(), Since(t0), kEps);
  EXPECT_NEAR(Cause(g, "rendezvous"), 3, kEps);
  EXPECT_NEAR(g.productive_seconds(), 10, kEps);
  EXPECT_NEAR(Cause(g, "in_flight"), 32 - 11, kEps);
  const v1::GetStatusResponse status = second.Status("kept");
  v1::MemberCredentials c0, c1;
  for (const auto& [c, rank] : {std::pair{&c0, 0}, std::pair{&c1, 1}}) {
    c->set_job_id("kept");
    c->set_generation(status.jobs(0).generation());
    c->set_rank(rank);
  }
  // The tokens are the first server's, restored with the job: read from the store.
  auto jobs = (*state)->LoadJobs();
  ASSERT_TRUE(jobs.ok());
  c0.set_token((*jobs)[0].members[0].token);
  c1.set_token((*jobs)[0].members[1].token);
  v1::TimeLedger caught_up = Ledger(1, 30);  // cumulative: the 20 s down included
  ASSERT_TRUE(BeatWith(second, c0, 50, &caught_up).ok());
  g = Goodput(second, "kept");
  EXPECT_NEAR(g.productive_seconds(), 30, kEps);
  EXPECT_NEAR(Sum(g), g.wall_seconds(), kEps);
  ASSERT_TRUE(second.Leave(c0).ok());
  ASSERT_TRUE(second.Leave(c1).ok());
  auto saved = (*state)->LoadGoodput();
  ASSERT_TRUE(saved.ok());
  EXPECT_EQ(saved->count("kept"), 1u);
  second.Tick();  // idle from here
  clock_.Advance(options_.job_ttl + absl::Seconds(1));
  second.Tick();
  ASSERT_EQ(second.Status("kept").jobs_size(), 0);  // forgotten
  saved = (*state)->LoadGoodput();
  ASSERT_TRUE(saved.ok());
  EXPECT_EQ(saved->count("kept"), 0u);
}

}  // namespace
}  // namespace zeroshard
