// GetStatus (shard_server/membership/status.cc): steps, telemetry, generation history, snapshots
// and recoveries as members reported them, and DiLoCo's outer steps.
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
  for (const auto& line : lines_)
    logged = logged || line.find("recovery_training") != std::string::npos;
  EXPECT_TRUE(logged);
}

// DiLoCo's outer steps (docs/diloco.md, "Elastic outer steps"): rank 0
// resends its last few with every beat; the server keeps each (generation,
// after_step) once, in order, the last 16, with the worker ids of the ranks
// that took part; a record naming workers itself, or too many records, is
// refused naming the field.
TEST_F(MembershipTest, StatusKeepsEachOuterStepOnceWithTheWorkersThatTookPart) {
  std::vector<v1::JoinResponse> members = Form("outer", 4);
  auto record = [](int64_t after, int groups) {
    v1::OuterStepRecord r;
    r.set_outer_step(after / 5);
    r.set_after_step(after);
    r.set_generation(1);
    r.set_groups(groups);
    r.set_group_size(2);
    return r;
  };
  v1::HeartbeatRequest beat;
  *beat.mutable_member() = Credentials("outer", members[0]);
  *beat.add_outer_steps() = record(5, 2);
  *beat.add_outer_steps() = record(10, 1);
  ASSERT_TRUE(membership_->Heartbeat(beat).ok());
  *beat.add_outer_steps() = record(15, 2);  // the two before, sent again
  ASSERT_TRUE(membership_->Heartbeat(beat).ok());
  v1::JobStatus job = membership_->Status("outer").jobs(0);
  ASSERT_EQ(job.outer_steps_size(), 3) << job.DebugString();
  EXPECT_EQ(job.outer_steps(0).after_step(), 5);
  EXPECT_EQ(absl::StrJoin(job.outer_steps(0).workers(), ","), "w0,w1,w2,w3");
  EXPECT_EQ(absl::StrJoin(job.outer_steps(1).workers(), ","), "w0,w1");
  EXPECT_EQ(job.outer_steps(2).after_step(), 15);
  // The window: the last 16.
  for (int64_t after = 20; after <= 100; after += 5) {
    beat.clear_outer_steps();
    *beat.add_outer_steps() = record(after, 2);
    ASSERT_TRUE(membership_->Heartbeat(beat).ok());
  }
  job = membership_->Status("outer").jobs(0);
  ASSERT_EQ(job.outer_steps_size(), 16);
  EXPECT_EQ(job.outer_steps(0).after_step(), 25);
  EXPECT_EQ(job.outer_steps(15).after_step(), 100);
  // Refused: worker ids from the worker, and more than 8 records.
  beat.clear_outer_steps();
  v1::OuterStepRecord named = record(105, 2);
  named.add_workers("someone");
  *beat.add_outer_steps() = named;
  absl::Status refused = membership_->Heartbeat(beat).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << refused;
  EXPECT_NE(refused.message().find("HeartbeatRequest.outer_steps"), std::string::npos) << refused;
  beat.clear_outer_steps();
  for (int i = 0; i < 9; ++i) *beat.add_outer_steps() = record(105 + 5 * i, 2);
  EXPECT_EQ(membership_->Heartbeat(beat).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(membership_->Status("outer").jobs(0).outer_steps_size(), 16);
}

// --outer_timeout: the quorum's groups (present_groups, a bit each) name the
// workers, whichever groups they are: group 1 alone is w2,w3, not the first
// group's w0,w1; both, all four.
TEST_F(MembershipTest, AnOuterStepOfSomeGroupsNamesTheirWorkers) {
  std::vector<v1::JoinResponse> members = Form("quorum", 4);
  auto record = [](int64_t after, uint64_t present, int groups) {
    v1::OuterStepRecord r;
    r.set_outer_step(after / 2);
    r.set_after_step(after);
    r.set_generation(1);
    r.set_groups(groups);
    r.set_group_size(2);
    r.set_present_groups(present);
    return r;
  };
  v1::HeartbeatRequest beat;
  *beat.mutable_member() = Credentials("quorum", members[0]);
  *beat.add_outer_steps() = record(2, 0b10, 1);
  *beat.add_outer_steps() = record(4, 0b01, 1);
  *beat.add_outer_steps() = record(6, 0b11, 2);
  ASSERT_TRUE(membership_->Heartbeat(beat).ok());
  const v1::JobStatus job = membership_->Status("quorum").jobs(0);
  ASSERT_EQ(job.outer_steps_size(), 3) << job.DebugString();
  EXPECT_EQ(absl::StrJoin(job.outer_steps(0).workers(), ","), "w2,w3");
  EXPECT_EQ(absl::StrJoin(job.outer_steps(1).workers(), ","), "w0,w1");
  EXPECT_EQ(absl::StrJoin(job.outer_steps(2).workers(), ","), "w0,w1,w2,w3");
}

}  // namespace
}  // namespace zeroshard
