// Membership's core: the join barrier, generations a job moves through, and jobs forgotten once
// idle (shard_server/membership/membership.cc).
#include "shard_server/membership/membership.h"

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "shard_server/state/state_store.h"
#include "tests/shard_server/membership/membership_fixture.h"

namespace zeroshard {
namespace {

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

TEST_F(MembershipTest, FinishedJobCanStartAgainWithAnotherWorldSize) {
  auto members = Form("job", 2);
  ASSERT_TRUE(membership_->Leave(Credentials("job", members[0])).ok());
  ASSERT_TRUE(membership_->Leave(Credentials("job", members[1])).ok());
  auto again = Form("job", 3);
  EXPECT_EQ(again[0].world_size(), 3);
  EXPECT_GT(again[0].generation(), members[0].generation());
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

}  // namespace
}  // namespace zeroshard
