// The verdict every rank reaches on a step's gathered numbers
// (worker/zero/step_numerics.h) and what the worker does with it
// (worker/nonfinite_policy.h).
#include "worker/nonfinite_policy.h"

#include <cfloat>
#include <cmath>
#include <limits>
#include <vector>

#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "worker/zero/step_numerics.h"

namespace zeroshard {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

TEST(JudgeStepTest, FiniteStepsAverageTheLossAndSumShardsOverReplicas) {
  // W = 4 in groups of 2: every shard is held twice, so the sum over ranks
  // counts each shard's squares twice.
  const std::vector<RankNumerics> ranks = {{1, 1}, {2, 3}, {3, 1}, {6, 3}};
  const StepVerdict v = JudgeStep(ranks, /*shards_summed=*/true, /*group_size=*/2, 0);
  EXPECT_TRUE(v.finite());
  EXPECT_EQ(v.mean_loss, 3.0);
  EXPECT_EQ(v.grad_norm, std::sqrt(4.0));
  EXPECT_EQ(v.first_rank, -1);
}

// An uneven shrink under --keep_global_batch: rank 0 trained two of the
// step's four micro-batches (mean loss 3), ranks 1 and 2 one each (losses 1
// and 5). The step's loss is the mean over the micro-batches, (2 x 3 + 1 +
// 5) / 4 = 3, not over the ranks (3 + 1 + 5) / 3; equal counts keep the
// plain mean over ranks (the same bits as before the counts were sent).
TEST(JudgeStepTest, RanksWithFewerMicroBatchesWeighLessInTheLoss) {
  auto rank = [](double loss, double micro_batches) {
    RankNumerics r;
    r.loss = loss;
    r.grad_squares = 1;
    r.micro_batches = micro_batches;
    return r;
  };
  EXPECT_EQ(JudgeStep({rank(3, 2), rank(1, 1), rank(5, 1)}, true, 3, 0).mean_loss, 3.0);
  EXPECT_EQ(JudgeStep({rank(3, 2), rank(1, 2), rank(5, 2)}, true, 3, 0).mean_loss,
            (3.0 + 1.0 + 5.0) / 3);
  EXPECT_EQ(JudgeStep({rank(4, 3), rank(1, 1)}, true, 2, 0).mean_loss, 13.0 / 4);
}

// DiLoCo (--sync=diloco): W = 4 as groups {0, 1} and {2, 3} whose
// gradients differ; each rank's norm is its own group's (squares 1 + 3 and
// 1 + 8), not the replicas' mean.
TEST(JudgeStepTest, DiLoCoTakesTheOwnGroupsNorm) {
  const std::vector<RankNumerics> ranks = {{1, 1}, {2, 3}, {3, 1}, {6, 8}};
  for (int rank : {0, 1}) {
    EXPECT_EQ(JudgeStep(ranks, true, 2, rank, /*group_norms=*/true).grad_norm, 2.0) << rank;
  }
  for (int rank : {2, 3}) {
    EXPECT_EQ(JudgeStep(ranks, true, 2, rank, true).grad_norm, 3.0) << rank;
  }
  EXPECT_EQ(JudgeStep(ranks, true, 2, 0, true).mean_loss, 3.0);
}

// One group's norm overflows: every rank, the other group's included,
// judges the step not finite, so the groups stay at the same step.
TEST(JudgeStepTest, DiLoCoAGroupsNonFiniteNormStopsEveryRank) {
  const std::vector<RankNumerics> ranks = {{1, 1}, {1, 1}, {1, kInf}, {1, 1}};
  for (int rank = 0; rank < 4; ++rank) {
    const StepVerdict v = JudgeStep(ranks, true, 2, rank, true);
    EXPECT_EQ(v.nonfinite, NonFiniteQuantity::kGradNorm) << rank;
    EXPECT_EQ(v.first_rank, 2) << rank;
  }
}

TEST(JudgeStepTest, StageZeroTakesItsOwnFullGradientsNorm) {
  const StepVerdict v = JudgeStep({{1, 9}, {1, 9}}, /*shards_summed=*/false, 2, 1);
  EXPECT_EQ(v.grad_norm, 3.0);
}

TEST(JudgeStepTest, TheFirstRankWithANonFiniteLossIsNamed) {
  for (double bad : {kNaN, kInf, -kInf, 1e60}) {
    const StepVerdict v = JudgeStep({{1, 1}, {1, 1}, {bad, 1}, {bad, 1}}, true, 4, 0);
    EXPECT_FALSE(v.finite()) << bad;
    EXPECT_EQ(v.nonfinite, NonFiniteQuantity::kLoss) << bad;
    EXPECT_EQ(v.first_rank, 2) << bad;
  }
}

TEST(JudgeStepTest, TheLossIsNamedBeforeTheNorm) {
  const StepVerdict v = JudgeStep({{1, kNaN}, {kInf, 1}}, true, 2, 0);
  EXPECT_EQ(v.nonfinite, NonFiniteQuantity::kLoss);
  EXPECT_EQ(v.first_rank, 1);
}

TEST(JudgeStepTest, ANonFiniteNormNamesTheRankWhoseShardOverflowed) {
  const StepVerdict v = JudgeStep({{1, 1}, {1, kInf}, {1, kNaN}}, true, 3, 0);
  EXPECT_EQ(v.nonfinite, NonFiniteQuantity::kGradNorm);
  EXPECT_EQ(v.first_rank, 1);
  EXPECT_EQ(v.Describe(), "the gradient norm is nan on rank 1");
}

TEST(JudgeStepTest, ANormBeyondFloat32IsNotFinite) {
  // Each part alone fits in f32; the norm of both does not.
  const double part = 0.75 * double{FLT_MAX} * double{FLT_MAX};
  const StepVerdict v = JudgeStep({{1, part}, {1, part}}, true, 2, 0);
  EXPECT_EQ(v.nonfinite, NonFiniteQuantity::kGradNorm);
  EXPECT_EQ(v.first_rank, 0);
  EXPECT_NE(v.Describe().find("beyond float32's range"), std::string::npos) << v.Describe();
}

TEST(JudgeStepTest, ReplicasAreComparedOnlyWhenEveryRankSentItsChecksum) {
  // W = 4 in groups of 2: ranks 1 and 3 hold member 1's shard.
  std::vector<RankNumerics> ranks(4, RankNumerics{1, 1, 0, 1});
  ranks[0].shard_checksum = ranks[2].shard_checksum = 5;
  ranks[1].shard_checksum = 6;
  ranks[3].shard_checksum = 7;
  StepVerdict v = JudgeStep(ranks, true, 2, 0);
  EXPECT_TRUE(v.finite());
  EXPECT_FALSE(v.apply()) << "a step on corrupted replicas is not applied";
  ASSERT_EQ(v.replica_mismatches.size(), 1u);
  EXPECT_EQ(v.replica_mismatches[0].ranks, (std::vector<int>{1, 3}));
  ranks[3].has_checksum = 0;  // a rank that did not hash: nothing is compared
  v = JudgeStep(ranks, true, 2, 0);
  EXPECT_FALSE(v.replicas_compared);
  EXPECT_TRUE(v.apply());
}

StepVerdict NaNLossOnRank(int rank) {
  std::vector<RankNumerics> ranks(2, RankNumerics{1, 1});
  ranks[rank].loss = kNaN;
  return JudgeStep(ranks, true, 2, 0);
}

TEST(NonFinitePolicyTest, StopReturnsTheLineNamingStepRankAndRows) {
  NonFinitePolicy policy({OnNonFinite::kStop, 10});
  EXPECT_TRUE(policy.Judge(0, 10, JudgeStep({{1, 1}, {1, 1}}, true, 2, 0), "").ok());
  const absl::Status s = policy.Judge(3, 10, NaNLossOnRank(1), "rows 28-31 of d.safetensors");
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  EXPECT_TRUE(IsNonFiniteStop(s));
  EXPECT_TRUE(absl::StartsWith(
      s.message(),
      "step 4/10: the loss is nan on rank 1 (its data: rows 28-31 of d.safetensors); stopping"))
      << s;
  EXPECT_FALSE(IsNonFiniteStop(absl::FailedPreconditionError("other")));
}

TEST(NonFinitePolicyTest, SkipCountsAndStopsAfterTheLimitInARow) {
  NonFinitePolicy policy({OnNonFinite::kSkip, 2});
  const StepVerdict finite = JudgeStep({{1, 1}, {1, 1}}, true, 2, 0);
  EXPECT_TRUE(policy.Judge(1, 10, NaNLossOnRank(0), "").ok());
  EXPECT_TRUE(policy.Judge(2, 10, NaNLossOnRank(0), "").ok());
  EXPECT_EQ(policy.skipped_in_a_row(), 2);
  EXPECT_TRUE(policy.Judge(3, 10, finite, "").ok());  // the run resets "in a row"
  EXPECT_EQ(policy.skipped_in_a_row(), 0);
  EXPECT_TRUE(policy.Judge(4, 10, NaNLossOnRank(1), "").ok());
  EXPECT_TRUE(policy.Judge(5, 10, NaNLossOnRank(1), "").ok());
  const absl::Status s = policy.Judge(6, 10, NaNLossOnRank(1), "");
  EXPECT_TRUE(IsNonFiniteStop(s)) << s;
  EXPECT_NE(s.message().find("3 steps in a row were not finite (--max_skipped_steps=2)"),
            std::string::npos)
      << s;
  EXPECT_EQ(policy.skipped_total(), 4);
}

TEST(NonFinitePolicyTest, ZeroSkipsAllowedStopsAtTheFirst) {
  NonFinitePolicy policy({OnNonFinite::kSkip, 0});
  EXPECT_TRUE(IsNonFiniteStop(policy.Judge(0, 10, NaNLossOnRank(0), "")));
}

TEST(NonFinitePolicyTest, TheFlagTakesStopOrSkip) {
  OnNonFinite mode;
  EXPECT_TRUE(ParseOnNonFinite("skip", &mode).ok());
  EXPECT_EQ(mode, OnNonFinite::kSkip);
  const absl::Status s = ParseOnNonFinite("ignore", &mode);
  EXPECT_TRUE(absl::IsInvalidArgument(s));
  EXPECT_NE(s.message().find("--on_nonfinite=ignore: expected stop"), std::string::npos) << s;
}

}  // namespace
}  // namespace zeroshard
