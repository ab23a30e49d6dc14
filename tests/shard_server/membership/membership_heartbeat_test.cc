// Heartbeats and leave (shard_server/membership/heartbeats.cc, leave.cc): fencing, the answers to
// an agent's beats, resumed beats in the log, a clean exit.
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "shard_server/membership/membership.h"
#include "tests/shard_server/membership/membership_fixture.h"

namespace zeroshard {
namespace {

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
    std::vector<absl::StatusOr<v1::HeartbeatResponse>> answers =
        membership_->Heartbeats({{&requests[0], 11}, {&requests[1], 12}, {&requests[2], 13}});
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

TEST_F(MembershipTest, CleanLeaveIsNotAFailureAndFinishesTheJob) {
  std::vector<std::pair<std::string, int64_t>> dropped;
  membership_->SetGenerationListener([&](const std::string& job, int64_t g) {
    dropped.push_back({job, g});
  });
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

}  // namespace
}  // namespace zeroshard
