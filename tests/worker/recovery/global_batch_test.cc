// PlanGlobalBatch (worker/recovery/global_batch.h): the micro-batches per
// rank of a shrunk generation, and that they are the original step's rows.
#include "worker/recovery/global_batch.h"

#include <cstdint>
#include <vector>

#include "gtest/gtest.h"
#include "worker/data/regression_data.h"

namespace zeroshard {
namespace {

TEST(GlobalBatchTest, AtTheOriginalWorldNothingChanges) {
  GlobalBatchPlan plan = PlanGlobalBatch(true, 4, 4, 3, 8);
  EXPECT_EQ(plan.grad_accum, 3);
  EXPECT_TRUE(plan.kept);
  EXPECT_EQ(plan.note, "");
  EXPECT_EQ(PlanGlobalBatch(false, 4, 4, 3, 8).grad_accum, 3);
}

TEST(GlobalBatchTest, AShrinkThatDividesAccumulatesTheMissingRanksMicroBatches) {
  struct Case {
    int original, world, accum, want;
  };
  for (const Case& c : {Case{4, 2, 1, 2}, Case{4, 1, 1, 4}, Case{2, 1, 1, 2}, Case{4, 3, 3, 4},
                        Case{4, 2, 3, 6}, Case{3, 2, 2, 3}}) {
    GlobalBatchPlan plan = PlanGlobalBatch(true, c.original, c.world, c.accum, 8);
    EXPECT_EQ(plan.grad_accum, c.want) << c.original << " -> " << c.world << ", A " << c.accum;
    EXPECT_TRUE(plan.kept);
    EXPECT_NE(plan.note.find("the global batch stays"), std::string::npos) << plan.note;
  }
}

TEST(GlobalBatchTest, AShrinkThatDoesNotDivideKeepsThePerRankBatchAndSaysWhy) {
  GlobalBatchPlan plan = PlanGlobalBatch(true, 4, 3, 1, 8);
  EXPECT_EQ(plan.grad_accum, 1);
  EXPECT_FALSE(plan.kept);
  EXPECT_NE(plan.note.find("cannot be kept"), std::string::npos) << plan.note;
  EXPECT_NE(plan.note.find("4 micro-batches (4 ranks x --grad_accum=1) do not split evenly over "
                           "3 ranks"),
            std::string::npos)
      << plan.note;
  EXPECT_NE(plan.note.find("shrinks from 32 to 24 samples"), std::string::npos) << plan.note;
}

TEST(GlobalBatchTest, OffKeepsThePerRankBatch) {
  GlobalBatchPlan plan = PlanGlobalBatch(false, 4, 2, 1, 8);
  EXPECT_EQ(plan.grad_accum, 1);
  EXPECT_FALSE(plan.kept);
  EXPECT_NE(plan.note.find("--keep_global_batch=false"), std::string::npos) << plan.note;
  EXPECT_NE(plan.note.find("from 32 to 16 samples"), std::string::npos) << plan.note;
}

TEST(GlobalBatchTest, TheSizesThatCannotKeepItAreNamedAhead) {
  EXPECT_EQ(SizesThatCannotKeepTheGlobalBatch(4, 0, 1), std::vector<int>{});  // never shrinks
  EXPECT_EQ(SizesThatCannotKeepTheGlobalBatch(4, 1, 1), std::vector<int>{3});
  EXPECT_EQ(SizesThatCannotKeepTheGlobalBatch(4, 2, 3), std::vector<int>{});  // 12 = 3 x 4 = 2 x 6
  EXPECT_EQ(SizesThatCannotKeepTheGlobalBatch(8, 5, 1), (std::vector<int>{5, 6, 7}));
  EXPECT_EQ(SizesThatCannotKeepTheGlobalBatch(4, 4, 1), std::vector<int>{});  // no shrink allowed
}

// The property the worker relies on: at (W', A') every step covers the
// original step's rows, each once, and survivor r''s micro-batch m' is
// original micro-batch k = m' W' + r' (original rank k mod W0, micro k / W0).
TEST(GlobalBatchTest, TheShrunkStepTakesTheOriginalStepsRowsInTheOriginalOrder) {
  const int batch = 4;
  for (int original : {2, 3, 4}) {
    for (int accum : {1, 2, 3}) {
      for (int world = 1; world < original; ++world) {
        GlobalBatchPlan plan = PlanGlobalBatch(true, original, world, accum, batch);
        if (!plan.kept) continue;
        for (int64_t step : {0, 1, 7}) {
          for (int m = 0; m < plan.grad_accum; ++m) {
            for (int r = 0; r < world; ++r) {
              const int k = m * world + r;
              absl::StatusOr<int64_t> got =
                  MicroBatchStartRow(step, m, r, world, batch, plan.grad_accum);
              absl::StatusOr<int64_t> want =
                  MicroBatchStartRow(step, k / original, k % original, original, batch, accum);
              ASSERT_TRUE(got.ok() && want.ok());
              EXPECT_EQ(*got, *want) << original << " -> " << world << ", A " << accum << ", step "
                                     << step << ", micro " << m << ", rank " << r;
            }
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace zeroshard
