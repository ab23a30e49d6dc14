// A job's world size after a death (shard_server/membership/shrink.cc, grow_back.cc): shrinking
// past --rejoin_grace, waiting for slow survivors, growing back.
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
  // Past a heartbeat timeout in the join barrier: the survivors beat no more
  // in the abandoned generation, but they are not dead. They were shown dead
  // and logged member_dead ('heartbeat timeout') beside the one that died.
  {
    const v1::JobStatus forming = membership_->Status("el").jobs(0);
    ASSERT_EQ(forming.members_size(), 3);
    for (int r = 0; r < 2; ++r) {
      EXPECT_TRUE(forming.members(r).alive()) << r;
      EXPECT_TRUE(forming.members(r).rejoined()) << r;
    }
    EXPECT_FALSE(forming.members(2).alive());
    EXPECT_FALSE(forming.members(2).rejoined());
    EXPECT_EQ(Logged("member_dead"), 1) << absl::StrJoin(lines_, "\n");
  }
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
            "grow back from 2 to 3 of 3 workers ('w2') once every member had the "
            "snapshot of step 30 (the job resumes from its latest common one)");
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

// With shard groups of 2 (JoinRequest.world_multiple), a job that shrank
// from 4 to 2 does not grow back to 3: the first grower waits across the
// members' snapshots until the second completes its group, then both join.
TEST_F(MembershipTest, GrowsBackOnlyToWholeShardGroups) {
  auto join = [&](const std::string& worker, JoinResult* out) {
    v1::JoinRequest request = Elastic(Request("groups", 4, worker), 2, 1000);
    request.set_world_multiple(2);
    membership_->Join(request, clock_.Now() + absl::Hours(1), [out](auto r) { *out = r; });
  };
  std::vector<JoinResult> first(4);
  for (int i = 0; i < 4; ++i) join(absl::StrCat("w", i), &first[i]);
  for (auto& r : first) ASSERT_TRUE(r && r->ok());
  clock_.Advance(absl::Seconds(2));
  for (int i = 0; i < 2; ++i) ASSERT_TRUE(Beat(Credentials("groups", **first[i])).ok());
  clock_.Advance(absl::Seconds(2));
  membership_->Tick();  // w2 and w3 dead
  std::vector<JoinResult> shrunk(2);
  for (int i = 0; i < 2; ++i) join(absl::StrCat("w", i), &shrunk[i]);
  clock_.Advance(absl::Seconds(2));
  membership_->Tick();
  for (auto& r : shrunk) ASSERT_TRUE(r && r->ok() && (*r)->world_size() == 2);
  const int64_t shrunk_generation = (*shrunk[0])->generation();
  auto beat = [&](int i, int64_t snapshot_step) {
    v1::HeartbeatRequest h;
    *h.mutable_member() = Credentials("groups", **shrunk[i]);
    h.set_snapshot_step(snapshot_step);
    return membership_->Heartbeat(h);
  };
  for (int i = 0; i < 2; ++i) ASSERT_TRUE(beat(i, 20).ok());
  JoinResult w3;
  join("w3", &w3);
  // Snapshots committed past the grower's arrival: no grow back to 3.
  for (int64_t step : {25, 30}) {
    clock_.Advance(absl::Milliseconds(300));
    for (int i = 0; i < 2; ++i) ASSERT_EQ(beat(i, step)->command(), v1::CONTINUE);
    membership_->Tick();
  }
  EXPECT_FALSE(w3.has_value());
  EXPECT_EQ(membership_->Status("groups").jobs(0).generation(), shrunk_generation);
  JoinResult w2;
  join("w2", &w2);
  clock_.Advance(absl::Milliseconds(300));
  for (int i = 0; i < 2; ++i) ASSERT_TRUE(beat(i, 35).ok());
  membership_->Tick();
  v1::JobStatus job = membership_->Status("groups").jobs(0);
  EXPECT_EQ(job.generation(), shrunk_generation + 1);
  EXPECT_EQ(job.history(job.history_size() - 1).reason(),
            "grow back from 2 to 4 of 4 workers ('w2', 'w3') once every member had the "
            "snapshot of step 35 (the job resumes from its latest common one)");
  std::vector<JoinResult> grown(2);
  for (int i = 0; i < 2; ++i) join(absl::StrCat("w", i), &grown[i]);
  for (JoinResult* r : {&w2, &w3, &grown[0], &grown[1]}) {
    ASSERT_TRUE(r->has_value() && (*r)->ok());
    EXPECT_EQ((**r)->world_size(), 4);
  }
}

// W = 4 in shard groups of 2 (JoinRequest.world_multiple, from a numeric
// --shard_group_size: HSDP every step and --sync=diloco send the same),
// --min_world_size=2, --rejoin_grace=1s; w3 dies and w0, w1, w2 re-join.
// A shrink to 3 would leave a world size no plan covers, so the job shrinks
// to the whole group (w0, w1) and w2, whose group lost w3, is parked: it
// waits as a grower.
class WholeGroupShrinkTest : public MembershipTest {
 protected:
  void SetUp() override {
    for (int i = 0; i < 4; ++i) JoinAs(absl::StrCat("w", i), &first_[i]);
    for (auto& r : first_) ASSERT_TRUE(r && r->ok());
    clock_.Advance(absl::Seconds(2));
    for (int i = 0; i < 3; ++i) ASSERT_TRUE(Beat(Credentials("groups", **first_[i])).ok());
    clock_.Advance(absl::Seconds(2));
    membership_->Tick();  // w3 silent for 4 s: dead, generation 2
    ASSERT_EQ(membership_->Status("groups").jobs(0).generation(), 2);
    for (int i = 0; i < 3; ++i) JoinAs(absl::StrCat("w", i), &again_[i]);
    clock_.Advance(absl::Milliseconds(500));
    membership_->Tick();
    for (const JoinResult& r : again_) ASSERT_FALSE(r.has_value()) << "formed within the grace";
    clock_.Advance(absl::Milliseconds(600));
    membership_->Tick();  // the grace is over
  }

  void JoinAs(const std::string& worker, JoinResult* out) {
    v1::JoinRequest request = Elastic(Request("groups", 4, worker), 2, 1000);
    request.set_world_multiple(2);
    membership_->Join(request, clock_.Now() + absl::Hours(1), [out](auto r) { *out = r; });
  }

  // Member `i` of the shrunk generation beats, having committed `snapshot`.
  void Beat2(int i, int64_t snapshot) {
    v1::HeartbeatRequest h;
    *h.mutable_member() = Credentials("groups", **again_[i]);
    h.set_snapshot_step(snapshot);
    absl::StatusOr<v1::HeartbeatResponse> r = membership_->Heartbeat(h);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->command(), v1::CONTINUE);
  }

  std::vector<JoinResult> first_ = std::vector<JoinResult>(4);
  std::vector<JoinResult> again_ = std::vector<JoinResult>(3);
};

TEST_F(WholeGroupShrinkTest, ShrinksToWholeGroupsAndTheParkedSurvivorGrowsBackWithAReplacement) {
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(again_[i] && again_[i]->ok())
        << (again_[i] ? again_[i]->status().ToString() : "no answer");
    EXPECT_EQ((*again_[i])->world_size(), 2);
    EXPECT_EQ((*again_[i])->rank(), i);  // old ranks 0 and 1 keep their places
    EXPECT_EQ((*again_[i])->generation(), 2);
  }
  EXPECT_FALSE(again_[2].has_value()) << "w2 was answered: " << again_[2]->status();
  v1::JobStatus job = membership_->Status("groups").jobs(0);
  EXPECT_EQ(job.state(), v1::RUNNING);
  EXPECT_EQ(job.world_size(), 2);
  const std::string parked = "'w2' (rank 2: its shard group, ranks 2-3, lost 'w3')";
  EXPECT_EQ(job.history(job.history_size() - 1).reason(),
            "shrunk from 4 to 2 workers after --rejoin_grace=1s; whole shard groups of 2 only: " +
                parked + " waits to grow the job back when its group is whole again");
  ASSERT_EQ(job.growing_size(), 1);
  EXPECT_EQ(job.growing(0), "w2");
  EXPECT_EQ(job.growing_note(), parked +
                                    " waits to grow job 'groups' back from 2 to 3 of 4 workers "
                                    "once they make whole shard groups of 2 (now 1 of 2)");
  EXPECT_EQ(Logged("recovery_shrink"), 1);
  EXPECT_EQ(Logged("grow_back_waiting"), 1);
  EXPECT_EQ(Logged("recovery_failed"), 0);

  // Snapshots pass: w2 alone is half a group, so no grow back to 3.
  for (int64_t step : {20, 25}) {
    clock_.Advance(absl::Milliseconds(300));
    for (int i = 0; i < 2; ++i) Beat2(i, step);
    membership_->Tick();
  }
  EXPECT_FALSE(again_[2].has_value());
  EXPECT_EQ(membership_->Status("groups").jobs(0).generation(), 2);
  // w3's replacement completes the group; the job grows back at the
  // members' next snapshot after it came (step 25 was before).
  JoinResult w3;
  JoinAs("w3", &w3);
  clock_.Advance(absl::Milliseconds(300));
  for (int i = 0; i < 2; ++i) Beat2(i, 25);
  membership_->Tick();
  EXPECT_EQ(membership_->Status("groups").jobs(0).generation(), 2);
  EXPECT_NE(membership_->Status("groups").jobs(0).growing_note().find(
                "at the members' next committed snapshot (after step 25)"),
            std::string::npos)
      << membership_->Status("groups").jobs(0).growing_note();
  clock_.Advance(absl::Milliseconds(300));
  for (int i = 0; i < 2; ++i) Beat2(i, 30);
  membership_->Tick();
  job = membership_->Status("groups").jobs(0);
  EXPECT_EQ(job.generation(), 3);
  EXPECT_EQ(job.history(job.history_size() - 1).reason(),
            "grow back from 2 to 4 of 4 workers ('w2', 'w3') once every member had the "
            "snapshot of step 30 (the job resumes from its latest common one)");
  std::vector<JoinResult> grown(2);
  for (int i = 0; i < 2; ++i) JoinAs(absl::StrCat("w", i), &grown[i]);
  for (JoinResult* r : {&grown[0], &grown[1], &again_[2], &w3}) {
    ASSERT_TRUE(r->has_value() && (*r)->ok()) << (r->has_value() ? (*r)->status().ToString() : "");
    EXPECT_EQ((**r)->world_size(), 4);
    EXPECT_EQ((**r)->generation(), 3);
  }
  EXPECT_EQ((*again_[2])->rank(), 2);
  EXPECT_EQ((*w3)->rank(), 3);
  EXPECT_EQ(membership_->Status("groups").jobs(0).growing_size(), 0);
}

// The parked survivor's join is bounded by its deadline (the worker's
// --rejoin_timeout; here the server's 60-s --join_timeout): when its group
// is not whole by then, it is told why, and the job goes on without it.
TEST_F(WholeGroupShrinkTest, AParkedSurvivorWhoseGroupStaysBrokenTimesOutSayingWhy) {
  ASSERT_TRUE(again_[0] && again_[0]->ok());
  for (int s = 0; s < 60 && !again_[2].has_value(); ++s) {
    clock_.Advance(absl::Seconds(1));
    for (int i = 0; i < 2; ++i) Beat2(i, 20);
    membership_->Tick();
  }
  ASSERT_TRUE(again_[2].has_value());
  EXPECT_EQ(again_[2]->status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(std::string(again_[2]->status().message()),
            "join of job 'groups' as 'w2' timed out after 1m waiting to grow the job back from 2 "
            "to 4 workers: the 1 waiting to grow it back do not make whole shard groups of 2 (1 of "
            "2); it was left out of the shrink to whole groups: 'w2' (rank 2: its shard group, "
            "ranks 2-3, lost 'w3'). The job goes on at 2 workers without it; start it again (or "
            "its group's lost workers) to grow the job back");
  v1::JobStatus job = membership_->Status("groups").jobs(0);
  EXPECT_EQ(job.state(), v1::RUNNING);
  EXPECT_EQ(job.generation(), 2);
  EXPECT_EQ(job.growing_size(), 0);
}

// The job finishes (every member leaves) while the survivor waits: its join
// ends OUT_OF_RANGE, which the worker takes as its job's success (exit 0).
TEST_F(WholeGroupShrinkTest, TheJobFinishingWhileASurvivorIsParkedEndsItsJoinOutOfRange) {
  for (int i = 0; i < 2; ++i) ASSERT_TRUE(again_[i] && again_[i]->ok());
  ASSERT_TRUE(membership_->Leave(Credentials("groups", **again_[0])).ok());
  EXPECT_FALSE(again_[2].has_value()) << "answered while a member trains";
  ASSERT_TRUE(membership_->Leave(Credentials("groups", **again_[1])).ok());
  ASSERT_TRUE(again_[2].has_value());
  EXPECT_EQ(again_[2]->status().code(), absl::StatusCode::kOutOfRange) << again_[2]->status();
  EXPECT_EQ(std::string(again_[2]->status().message()),
            "job 'groups' finished (every member left, generation 2) while this worker waited to "
            "grow it back: nothing is left for it to do");
  EXPECT_EQ(membership_->Status("groups").jobs(0).state(), v1::FINISHED);
  EXPECT_EQ(Logged("job_finished"), 1);
}

// Too few whole groups for --min_world_size: W = 4 in groups of 2 with
// --min_world_size=3 needs all 4 (whole groups); 3 re-joined and the dead
// one cannot come, so the recovery fails naming the group size.
TEST_F(MembershipTest, AShrinkBelowTheMinimumInWholeGroupsFailsNamingTheGroupSize) {
  auto join = [&](const std::string& worker, JoinResult* out) {
    v1::JoinRequest request = Elastic(Request("g3", 4, worker), 3, 1000);
    request.set_world_multiple(2);
    membership_->Join(request, clock_.Now() + absl::Hours(1), [out](auto r) { *out = r; });
  };
  std::vector<JoinResult> first(4);
  for (int i = 0; i < 4; ++i) join(absl::StrCat("w", i), &first[i]);
  clock_.Advance(absl::Seconds(2));
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(Beat(Credentials("g3", **first[i])).ok());
  clock_.Advance(absl::Seconds(2));
  membership_->Tick();
  std::vector<JoinResult> again(3);
  for (int i = 0; i < 3; ++i) join(absl::StrCat("w", i), &again[i]);
  clock_.Advance(absl::Milliseconds(1100));
  membership_->Tick();
  for (const JoinResult& r : again) {
    ASSERT_TRUE(r.has_value());
    EXPECT_EQ(r->status().code(), absl::StatusCode::kFailedPrecondition) << r->status();
    EXPECT_NE(r->status().message().find(
                  "only 3 of 4 workers re-joined ('w0', 'w1', 'w2') after --rejoin_grace=1s, of "
                  "whom 2 make whole shard groups of 2, and --min_world_size=3 needs 4 (whole "
                  "shard groups of 2); no other member can come; 'w3' (rank 3) was declared dead"),
              std::string::npos)
        << r->status();
  }
  EXPECT_EQ(Logged("recovery_failed"), 1);
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

}  // namespace
}  // namespace zeroshard
