// Persistence (shard_server/membership/persistence.cc): jobs restored by a restarted server, and
// changes that cannot be saved.
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
#include "tests/testing/state_faults.h"

namespace zeroshard {
namespace {

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
  // Why each generation began survives the restart, in order: the death and
  // the shrink that formed the same generation are two entries.
  ASSERT_EQ(job.history_size(), 3);
  EXPECT_EQ(job.history(0).reason(), "job created");
  EXPECT_EQ(job.history(1).generation(), job.history(2).generation());
  EXPECT_EQ(job.history(1).reason(), "worker 'w2' (rank 2) stopped heartbeating");
  EXPECT_EQ(job.history(2).reason().rfind("shrunk from 3 to 2 workers", 0), 0u)
      << job.history(2).reason();
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

// A finished job after a restart: its members show the step and loss they
// ended at (before, step 0 and loss 0: per-member figures were in memory
// only), and a dead member the step it last reported.
TEST_F(MembershipTest, ARestoredJobShowsWhereItsEndedMembersStopped) {
  std::string dir = testing::MakeTempDir("membership");
  {
    auto state = StateStore::Open(dir + "/state.db");
    ASSERT_TRUE(state.ok()) << state.status();
    Membership first(&clock_, &log_, state->get(), options_);
    std::vector<JoinResult> joins(3);
    for (int i = 0; i < 3; ++i) {
      first.Join(Request("ended", 3, absl::StrCat("w", i)), clock_.Now() + absl::Hours(1),
                 [&joins, i](auto r) { joins[i] = r; });
    }
    for (auto& r : joins) ASSERT_TRUE(r && r->ok());
    for (int i = 0; i < 3; ++i) {
      v1::HeartbeatRequest h;
      *h.mutable_member() = Credentials("ended", **joins[i]);
      h.set_step(40 + i);
      h.set_loss(1.5 + i);
      ASSERT_TRUE(first.Heartbeat(h).ok());
    }
    v1::LeaveRequest last;
    last.set_has_final(true);
    last.set_final_step(100);
    last.set_final_loss(0.25);
    // A step after the last beat skipped: the leave carries the count.
    last.mutable_final_last_step()->set_skipped_steps(2);
    last.mutable_final_last_step()->set_step_ms(12.5);
    v1::LeaveRequest oversized = last;
    oversized.final_last_step().GetReflection()
        ->MutableUnknownFields(oversized.mutable_final_last_step())
        ->AddLengthDelimited(999, std::string(200, 'x'));
    absl::Status refused = first.Leave(Credentials("ended", **joins[0]), &oversized);
    EXPECT_TRUE(absl::IsInvalidArgument(refused)) << refused;
    EXPECT_NE(refused.message().find("LeaveRequest.final_last_step is "), std::string::npos)
        << refused;
    ASSERT_TRUE(first.Leave(Credentials("ended", **joins[0]), &last).ok());
    ASSERT_TRUE(first.Leave(Credentials("ended", **joins[1]), nullptr).ok());
    clock_.Advance(absl::Seconds(4));  // w2 silent past the timeout
    first.Tick();
    ASSERT_FALSE(first.Status("ended").jobs(0).members(2).alive());
  }
  auto state = StateStore::Open(dir + "/state.db");
  ASSERT_TRUE(state.ok());
  Membership restored(&clock_, &log_, state->get(), options_);
  ASSERT_TRUE(restored.Restore().ok());
  v1::JobStatus job = restored.Status("ended").jobs(0);
  ASSERT_EQ(job.members_size(), 3);
  EXPECT_TRUE(job.members(0).left());
  EXPECT_EQ(job.members(0).step(), 100);  // its final step, from the leave
  EXPECT_DOUBLE_EQ(job.members(0).loss(), 0.25);
  EXPECT_EQ(job.members(0).last_step().skipped_steps(), 2);
  EXPECT_DOUBLE_EQ(job.members(0).last_step().step_ms(), 12.5);
  EXPECT_EQ(job.members(1).step(), 41);  // no final step sent: its last beat's
  EXPECT_DOUBLE_EQ(job.members(1).loss(), 2.5);
  EXPECT_FALSE(job.members(2).alive());
  EXPECT_EQ(job.members(2).step(), 42);
  EXPECT_DOUBLE_EQ(job.members(2).loss(), 3.5);
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

// EvictHost (fences.cc): the named rank's machine (its node) is fenced and
// its members declared dead at once; the fence is saved with the job, so a
// restarted server still refuses the machine's joins, naming it, why, and
// the command that lifts it; UnfenceHost lifts it (saved too).
TEST_F(MembershipTest, AnEvictedMachineStaysFencedAcrossARestartUntilUnfenced) {
  std::string dir = testing::MakeTempDir("membership");
  auto on = [&](const std::string& worker, const std::string& node) {
    v1::JoinRequest r = Request("fenced", 4, worker);
    r.set_node(node);
    return r;
  };
  const std::vector<std::string> nodes = {"hostA boot1", "hostA boot1", "hostB boot2",
                                          "hostB boot2"};
  {
    auto state = StateStore::Open(dir + "/state.db");
    ASSERT_TRUE(state.ok()) << state.status();
    Membership first(&clock_, &log_, state->get(), options_);
    std::vector<JoinResult> joins(4);
    for (int i = 0; i < 4; ++i) {
      first.Join(on(absl::StrCat("w", i), nodes[i]), clock_.Now() + absl::Hours(1),
                 [&joins, i](auto r) { joins[i] = r; });
    }
    for (auto& r : joins) ASSERT_TRUE(r && r->ok());
    v1::EvictHostRequest evict;
    *evict.mutable_member() = Credentials("fenced", **joins[2]);  // rank 2 asks
    evict.set_rank(1);
    evict.set_step(20);
    absl::StatusOr<v1::EvictHostResponse> evicted = first.EvictHost(evict);
    ASSERT_TRUE(evicted.ok()) << evicted.status();
    EXPECT_EQ(evicted->node(), "hostA boot1");
    EXPECT_FALSE(evicted->already());
    v1::GetStatusResponse status = first.Status("fenced");
    EXPECT_EQ(status.jobs(0).state(), v1::DEGRADED);  // at once: no heartbeat timeout
    EXPECT_FALSE(status.jobs(0).members(0).alive());
    EXPECT_FALSE(status.jobs(0).members(1).alive());
    EXPECT_TRUE(status.jobs(0).members(2).alive());
    ASSERT_EQ(status.jobs(0).fenced_hosts_size(), 1);
    EXPECT_EQ(status.jobs(0).fenced_hosts(0).reason(), "silent corruption on rank 1 at step 20");
    // Rank 3 asks too, with the old generation's credentials: already done.
    *evict.mutable_member() = Credentials("fenced", **joins[3]);
    evicted = first.EvictHost(evict);
    ASSERT_TRUE(evicted.ok()) << evicted.status();
    EXPECT_TRUE(evicted->already());
    EXPECT_EQ(Logged("host_evicted"), 1);
    // A rank outside the generation is refused, naming it.
    evict.set_rank(7);
    EXPECT_TRUE(absl::IsInvalidArgument(first.EvictHost(evict).status()));
  }
  auto state = StateStore::Open(dir + "/state.db");
  ASSERT_TRUE(state.ok());
  Membership restored(&clock_, &log_, state->get(), options_);
  ASSERT_TRUE(restored.Restore().ok());
  ASSERT_EQ(restored.Status("fenced").jobs(0).fenced_hosts_size(), 1);
  JoinResult refused;
  restored.Join(on("w0", "hostA boot1"), clock_.Now() + absl::Hours(1),
                [&](auto r) { refused = r; });
  ASSERT_TRUE(refused.has_value());
  ASSERT_TRUE(absl::IsFailedPrecondition(refused->status())) << refused->status();
  const std::string message(refused->status().message());
  EXPECT_NE(message.find("machine 'hostA boot1'"), std::string::npos) << message;
  EXPECT_NE(message.find("silent corruption on rank 1 at step 20"), std::string::npos) << message;
  EXPECT_NE(message.find("shardctl unfence --job=fenced --host=hostA"), std::string::npos)
      << message;
  // Lifted by hostname; saved, so a second restart does not bring it back.
  absl::StatusOr<v1::UnfenceHostResponse> lifted = restored.UnfenceHost("fenced", "hostA");
  ASSERT_TRUE(lifted.ok()) << lifted.status();
  ASSERT_EQ(lifted->nodes_size(), 1);
  EXPECT_EQ(lifted->nodes(0), "hostA boot1");
  EXPECT_EQ(restored.Status("fenced").jobs(0).fenced_hosts_size(), 0);
  auto reopened = StateStore::Open(dir + "/state.db");
  ASSERT_TRUE(reopened.ok());
  Membership again(&clock_, &log_, reopened->get(), options_);
  ASSERT_TRUE(again.Restore().ok());
  EXPECT_EQ(again.Status("fenced").jobs(0).fenced_hosts_size(), 0);
}

}  // namespace
}  // namespace zeroshard
