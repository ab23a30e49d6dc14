// A member that exits on a failure of the job's inputs (LeaveRequest.failure,
// shard_server/membership/leave.cc): the job is FAILED at once, the joins
// waiting in it and the re-joins of its members' processes are refused with
// the reason, and new processes start it again; a restored server keeps it.
#include <memory>
#include <optional>
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

constexpr char kWhy[] =
    "DATA_LOSS: recovery from disk (step 2): rank-1-of-2.safetensors does not match its "
    "recorded checksum";

class MembershipFailureTest : public MembershipTest {
 protected:
  // A join of worker `worker` from the process `incarnation`.
  v1::JoinRequest From(const std::string& worker, const std::string& incarnation, int world = 2) {
    v1::JoinRequest r = Request("job", world, worker);
    r.set_incarnation(incarnation);
    return r;
  }
  void JoinOn(Membership& m, const v1::JoinRequest& r, JoinResult* out) {
    m.Join(r, clock_.Now() + absl::Hours(1),
           [out](absl::StatusOr<v1::JoinResponse> a) { *out = std::move(a); });
  }
  // w0 and w1 from processes "p0" and "p1", formed.
  std::vector<v1::JoinResponse> FormProcesses(Membership& m) {
    std::vector<JoinResult> joins(2);
    for (int i = 0; i < 2; ++i) {
      JoinOn(m, From(absl::StrCat("w", i), absl::StrCat("p", i)), &joins[i]);
    }
    std::vector<v1::JoinResponse> by_rank(2);
    for (auto& r : joins) {
      EXPECT_TRUE(r && r->ok());
      if (r && r->ok()) by_rank[(*r)->rank()] = **r;
    }
    return by_rank;
  }
  static v1::LeaveRequest Failing(const std::string& why) {
    v1::LeaveRequest leave;
    leave.set_failure(why);
    return leave;
  }
};

TEST_F(MembershipFailureTest, FailsTheJobAndRefusesTheRunsProcessesButNotNewOnes) {
  std::vector<int64_t> bumps;
  membership_->SetGenerationListener([&](const std::string&, int64_t g) { bumps.push_back(g); });
  const auto members = FormProcesses(*membership_);
  const int64_t formed = members[0].generation();
  const v1::LeaveRequest failing = Failing(kWhy);
  ASSERT_TRUE(membership_->Leave(Credentials("job", members[1]), &failing).ok());
  v1::JobStatus job = membership_->Status("job").jobs(0);
  EXPECT_EQ(job.state(), v1::FAILED);
  // The generation ended: w0's heartbeats hear of it (the listener).
  ASSERT_EQ(bumps.size(), 1u);
  EXPECT_EQ(bumps[0], formed + 1);
  EXPECT_EQ(job.history(job.history_size() - 1).reason(),
            absl::StrCat("job failed: worker 'w1' (rank 1) failed: ", kWhy));
  EXPECT_EQ(Logged("job_failed"), 1);
  // w0's process re-joins, as a survivor does: refused with the reason (it
  // waited for w1 for --rejoin_timeout before).
  JoinResult w0;
  JoinOn(*membership_, From("w0", "p0"), &w0);
  ASSERT_TRUE(w0.has_value());
  EXPECT_TRUE(absl::IsFailedPrecondition(w0->status())) << w0->status();
  EXPECT_NE(w0->status().message().find(
                absl::StrCat("job 'job' failed: worker 'w1' (rank 1) failed: ", kWhy)),
            std::string::npos)
      << w0->status();
  EXPECT_NE(w0->status().message().find("worker 'w0' was part of that run"), std::string::npos)
      << w0->status();
  // Repeated, the leave changes nothing; a second failure does not fail it
  // again.
  ASSERT_TRUE(membership_->Leave(Credentials("job", members[1]), &failing).ok());
  const v1::LeaveRequest other = Failing("INVALID_ARGUMENT: another reason");
  ASSERT_TRUE(membership_->Leave(Credentials("job", members[0]), &other).ok());
  EXPECT_EQ(Logged("job_failed"), 1);
  EXPECT_EQ(membership_->Status("job").jobs(0).generation(), formed + 1);
  // The workers started again (new processes): the job runs again.
  std::vector<JoinResult> again(2);
  JoinOn(*membership_, From("w0", "q0"), &again[0]);
  JoinOn(*membership_, From("w1", "q1"), &again[1]);
  for (auto& r : again) ASSERT_TRUE(r && r->ok()) << (r ? r->status().ToString() : "none");
  job = membership_->Status("job").jobs(0);
  EXPECT_EQ(job.state(), v1::RUNNING);
  EXPECT_EQ(job.history(job.history_size() - 1).reason(), "job restarted after failing");
}

// A survivor whose re-join was waiting for the failed rank (its stream
// closed first: the server declared it dead) is answered at once.
TEST_F(MembershipFailureTest, AnswersAReJoinWaitingForTheFailedRank) {
  const auto members = FormProcesses(*membership_);
  clock_.Advance(absl::Seconds(2));
  ASSERT_TRUE(Beat(Credentials("job", members[1])).ok());
  clock_.Advance(absl::Seconds(2));
  membership_->Tick();  // w0 silent past the timeout: dead
  ASSERT_EQ(membership_->Status("job").jobs(0).state(), v1::DEGRADED);
  JoinResult w1;
  JoinOn(*membership_, From("w1", "p1"), &w1);
  ASSERT_FALSE(w1.has_value());  // waiting for w0
  // w0's leave comes after its death (stale credentials).
  const v1::LeaveRequest failing = Failing(kWhy);
  ASSERT_TRUE(membership_->Leave(Credentials("job", members[0]), &failing).ok());
  ASSERT_TRUE(w1.has_value());
  EXPECT_TRUE(absl::IsFailedPrecondition(w1->status())) << w1->status();
  EXPECT_NE(w1->status().message().find("worker 'w0' (rank 0) failed: DATA_LOSS"),
            std::string::npos)
      << w1->status();
  EXPECT_EQ(membership_->Status("job").jobs(0).state(), v1::FAILED);
}

TEST_F(MembershipFailureTest, AnOversizedFailureIsRefusedAndChangesNothing) {
  const auto members = FormProcesses(*membership_);
  const v1::LeaveRequest huge = Failing(std::string(1025, 'x'));
  const absl::Status refused = membership_->Leave(Credentials("job", members[0]), &huge);
  EXPECT_TRUE(absl::IsInvalidArgument(refused)) << refused;
  EXPECT_NE(refused.message().find("LeaveRequest.failure is 1025 bytes; at most 1024"),
            std::string::npos)
      << refused;
  EXPECT_EQ(membership_->Status("job").jobs(0).state(), v1::RUNNING);
}

// A restart of an ended job whose joins all time out before it forms goes
// back to the state it ended in (before, it showed JOINING with nobody
// joined until --job_ttl forgot it), and a later start still restarts it.
TEST_F(MembershipFailureTest, ARestartWhoseJoinsTimeOutGoesBackToTheEndedState) {
  for (const v1::JobState ended : {v1::FINISHED, v1::FAILED}) {
    const std::string name = v1::JobState_Name(ended);
    SCOPED_TRACE(name);
    membership_ = std::make_unique<Membership>(&clock_, &log_, nullptr, options_);
    const auto members = FormProcesses(*membership_);
    const v1::LeaveRequest failing = Failing(kWhy);
    for (const auto& m : members) {
      ASSERT_TRUE(
          membership_->Leave(Credentials("job", m), ended == v1::FAILED ? &failing : nullptr)
              .ok());
    }
    ASSERT_EQ(membership_->Status("job").jobs(0).state(), ended);
    JoinResult lonely;
    membership_->Join(From("w0", "n0"), clock_.Now() + absl::Seconds(2),
                      [&lonely](absl::StatusOr<v1::JoinResponse> r) { lonely = std::move(r); });
    ASSERT_EQ(membership_->Status("job").jobs(0).state(), v1::JOINING);
    clock_.Advance(absl::Seconds(3));
    membership_->Tick();
    ASSERT_TRUE(lonely.has_value());
    EXPECT_TRUE(absl::IsDeadlineExceeded(lonely->status())) << lonely->status();
    const v1::JobStatus job = membership_->Status("job").jobs(0);
    EXPECT_EQ(job.state(), ended);
    EXPECT_EQ(job.history(job.history_size() - 1).reason(),
              absl::StrCat("restart abandoned (its joins timed out): ", name, " again"));
    if (ended == v1::FAILED) {  // the run's processes are still refused
      JoinResult stale;
      JoinOn(*membership_, From("w1", "p1"), &stale);
      ASSERT_TRUE(stale.has_value());
      EXPECT_NE(stale->status().message().find(kWhy), std::string::npos) << stale->status();
    }
    std::vector<JoinResult> again(2);
    JoinOn(*membership_, From("w0", "r0"), &again[0]);
    JoinOn(*membership_, From("w1", "r1"), &again[1]);
    for (auto& r : again) ASSERT_TRUE(r && r->ok()) << (r ? r->status().ToString() : "none");
    EXPECT_EQ(membership_->Status("job").jobs(0).state(), v1::RUNNING);
  }
}

// A restarted server shows the job FAILED and why. The processes of the run
// are not saved (JoinRequest.incarnation), so a join after the restart starts
// the job again, as a new start does.
TEST_F(MembershipFailureTest, ARestoredServerShowsTheFailure) {
  const std::string dir = testing::MakeTempDir("membership_failure");
  {
    auto state = StateStore::Open(dir + "/state.db");
    ASSERT_TRUE(state.ok()) << state.status();
    Membership first(&clock_, &log_, state->get(), options_);
    const auto members = FormProcesses(first);
    const v1::LeaveRequest failing = Failing(kWhy);
    ASSERT_TRUE(first.Leave(Credentials("job", members[1]), &failing).ok());
  }
  auto state = StateStore::Open(dir + "/state.db");
  ASSERT_TRUE(state.ok());
  Membership restored(&clock_, &log_, state->get(), options_);
  ASSERT_TRUE(restored.Restore().ok());
  const v1::JobStatus job = restored.Status("job").jobs(0);
  EXPECT_EQ(job.state(), v1::FAILED);
  EXPECT_EQ(job.history(job.history_size() - 1).reason(),
            absl::StrCat("job failed: worker 'w1' (rank 1) failed: ", kWhy));
  std::vector<JoinResult> again(2);
  JoinOn(restored, From("w0", "p0"), &again[0]);
  JoinOn(restored, From("w1", "q1"), &again[1]);
  for (auto& r : again) ASSERT_TRUE(r && r->ok()) << (r ? r->status().ToString() : "none");
  EXPECT_EQ(restored.Status("job").jobs(0).state(), v1::RUNNING);
}

}  // namespace
}  // namespace zeroshard
