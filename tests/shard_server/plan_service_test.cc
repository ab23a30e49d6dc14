// The plan service: one plan per job generation, computed outside the
// service's lock, kept in a bounded cache in front of the state store.
#include "shard_server/plan_service.h"

#include <future>
#include <memory>
#include <string>

#include "absl/synchronization/notification.h"
#include "common/model_zoo.h"
#include "common/plan/plan_codec.h"
#include "common/plan/planner.h"
#include "gtest/gtest.h"
#include "shard_server/state/state_store.h"

namespace zeroshard {
namespace {

class PlanServiceTest : public ::testing::Test {
 protected:
  PlanServiceTest() : log_([](const std::string&) {}) { state_ = *StateStore::Open(":memory:"); }

  v1::ModelSpec Mlp(int layers) { return ModelSpecToProto(*MlpSpec(layers, 16, "none")); }

  EventLog log_;
  std::unique_ptr<StateStore> state_;
};

// Every wait in these tests has a deadline: a call that blocks where it must
// not fails the test instead of hanging it.
template <typename T>
bool ReadyWithin(std::future<T>& f, int seconds = 20) {
  return f.wait_for(std::chrono::seconds(seconds)) == std::future_status::ready;
}

TEST_F(PlanServiceTest, AJobWhosePlanIsBeingComputedBlocksNoOtherJobNorStatus) {
  absl::Notification computing, release;
  PlanServiceOptions options;
  options.planner = [&](const ModelSpec& spec, int world, const PlanOptions& plan_options) {
    if (spec.tensors.size() == 20) {  // job "big"'s model: held until released
      computing.Notify();
      release.WaitForNotificationWithTimeout(absl::Seconds(30));
    }
    return Plan(spec, world, plan_options);
  };
  PlanService plans(state_.get(), &log_, options);
  auto big = std::async(std::launch::async,
                        [&] { return plans.Plan("big", 1, 2, Mlp(10), v1::PlanOptions()); });
  ASSERT_TRUE(computing.WaitForNotificationWithTimeout(absl::Seconds(20)));

  // While "big" computes: status and another job are answered.
  auto status = std::async(std::launch::async, [&] { return plans.PlanHash("big"); });
  ASSERT_TRUE(ReadyWithin(status)) << "PlanHash waited for another job's plan";
  EXPECT_EQ(status.get(), "");
  auto small = std::async(std::launch::async,
                          [&] { return plans.Plan("small", 1, 2, Mlp(2), v1::PlanOptions()); });
  ASSERT_TRUE(ReadyWithin(small)) << "another job's Plan waited for this one";
  EXPECT_TRUE(small.get().ok());
  // A second rank of "big" waits for the one computation, and gets its plan.
  auto second = std::async(std::launch::async,
                           [&] { return plans.Plan("big", 1, 2, Mlp(10), v1::PlanOptions()); });
  EXPECT_EQ(second.wait_for(std::chrono::milliseconds(100)), std::future_status::timeout);

  release.Notify();
  ASSERT_TRUE(ReadyWithin(big));
  ASSERT_TRUE(ReadyWithin(second));
  absl::StatusOr<v1::ShardPlan> first = big.get();
  absl::StatusOr<v1::ShardPlan> other = second.get();
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_TRUE(other.ok()) << other.status();
  EXPECT_EQ(first->SerializeAsString(), other->SerializeAsString());
  EXPECT_EQ(plans.PlanHash("big"), first->hash());
}

TEST_F(PlanServiceTest, TheCacheIsBoundedAndADroppedPlanComesBackFromTheStore) {
  PlanServiceOptions options;
  options.max_cached_plans = 4;
  PlanService plans(state_.get(), &log_, options);
  absl::StatusOr<v1::ShardPlan> first = plans.Plan("job", 1, 2, Mlp(3), v1::PlanOptions());
  ASSERT_TRUE(first.ok()) << first.status();
  for (int generation = 2; generation <= 40; ++generation) {
    ASSERT_TRUE(plans.Plan("job", generation, 2, Mlp(3), v1::PlanOptions()).ok());
    EXPECT_LE(plans.cached_plans(), 4u);
  }
  // Generation 1's plan was dropped from memory: read back, the same, and
  // still bound to its spec.
  absl::StatusOr<v1::ShardPlan> again = plans.Plan("job", 1, 2, Mlp(3), v1::PlanOptions());
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->SerializeAsString(), first->SerializeAsString());
  EXPECT_EQ(plans.Plan("job", 1, 2, Mlp(4), v1::PlanOptions()).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

// A restarted server, or the new leader after an etcd failover, is a new
// PlanService over the same durable state: status shows the plan of each
// job's newest planned generation before any rank asks for it again.
TEST_F(PlanServiceTest, ANewServiceReadsThePlanHashBackFromTheStore) {
  std::string newest;
  {
    PlanService before(state_.get(), &log_);
    ASSERT_TRUE(before.Plan("job", 1, 2, Mlp(3), v1::PlanOptions()).ok());
    absl::StatusOr<v1::ShardPlan> second = before.Plan("job", 2, 4, Mlp(3), v1::PlanOptions());
    ASSERT_TRUE(second.ok()) << second.status();
    newest = second->hash();
    ASSERT_FALSE(newest.empty());
    EXPECT_EQ(before.PlanHash("job"), newest);
  }
  PlanService after(state_.get(), &log_);
  EXPECT_EQ(after.PlanHash("job"), newest);
  EXPECT_EQ(after.PlanHash("unplanned"), "");
  // A plan computed later is the newer one, whatever was read before.
  absl::StatusOr<v1::ShardPlan> third = after.Plan("unplanned", 1, 3, Mlp(2), v1::PlanOptions());
  ASSERT_TRUE(third.ok()) << third.status();
  EXPECT_EQ(after.PlanHash("unplanned"), third->hash());
  // A forgotten job's plans go with it (DeleteJob) and so does what status shows.
  ASSERT_TRUE(state_->DeleteJob("job").ok());
  after.ForgetJob("job");
  EXPECT_EQ(after.PlanHash("job"), "");
}

TEST_F(PlanServiceTest, ARefusedSpecStoresNothing) {
  PlanService plans(state_.get(), &log_);
  v1::ModelSpec bad = Mlp(2);
  bad.mutable_tensors(0)->set_dtype("F8");
  EXPECT_EQ(plans.Plan("job", 1, 2, bad, v1::PlanOptions()).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(plans.Plan("job", 1, 2, Mlp(2), v1::PlanOptions()).ok());
}

}  // namespace
}  // namespace zeroshard
