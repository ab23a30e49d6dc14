// PlanGlobalBatch (worker/recovery/global_batch.h) and BatchLayout
// (worker/data/batch_layout.h): the micro-batches each rank of a shrunk
// generation trains, and that together they are the original step's rows,
// each once, in the original order.
#include "worker/recovery/global_batch.h"

#include <algorithm>
#include <cstdint>
#include <set>
#include <vector>

#include "gtest/gtest.h"
#include "worker/data/regression_data.h"

namespace zeroshard {
namespace {

TEST(GlobalBatchTest, AtTheOriginalWorldNothingChanges) {
  GlobalBatchPlan plan = PlanGlobalBatch(true, 4, 4, 3, 8);
  EXPECT_EQ(plan.layout.Passes(), 3);
  EXPECT_EQ(plan.layout.DataMicroBatches(3), 3);
  EXPECT_EQ(plan.layout.data_world, 4);
  EXPECT_TRUE(plan.layout.Even());
  EXPECT_TRUE(plan.kept);
  EXPECT_EQ(plan.note, "");
  EXPECT_EQ(PlanGlobalBatch(false, 4, 4, 3, 8).layout.Passes(), 3);
}

TEST(GlobalBatchTest, AShrinkThatDividesAccumulatesTheMissingRanksMicroBatches) {
  struct Case {
    int original, world, accum, want;
  };
  for (const Case& c : {Case{4, 2, 1, 2}, Case{4, 1, 1, 4}, Case{2, 1, 1, 2}, Case{4, 3, 3, 4},
                        Case{4, 2, 3, 6}, Case{3, 2, 2, 3}}) {
    GlobalBatchPlan plan = PlanGlobalBatch(true, c.original, c.world, c.accum, 8);
    EXPECT_TRUE(plan.layout.Even());
    EXPECT_EQ(plan.layout.Passes(), c.want) << c.original << " -> " << c.world << ", A " << c.accum;
    for (int r = 0; r < c.world; ++r) EXPECT_EQ(plan.layout.DataMicroBatches(r), c.want);
    EXPECT_TRUE(plan.kept);
    EXPECT_NE(plan.note.find("the global batch stays"), std::string::npos) << plan.note;
  }
}

TEST(GlobalBatchTest, AnUnevenShrinkGivesTheFirstRanksOneMicroBatchMore) {
  GlobalBatchPlan plan = PlanGlobalBatch(true, 4, 3, 1, 8);
  EXPECT_TRUE(plan.kept);
  EXPECT_FALSE(plan.layout.Even());
  EXPECT_EQ(plan.layout.MicroBatches(), 4);
  EXPECT_EQ(plan.layout.Passes(), 2);
  EXPECT_EQ(plan.layout.DataMicroBatches(0), 2);
  EXPECT_EQ(plan.layout.DataMicroBatches(1), 1);
  EXPECT_EQ(plan.layout.DataMicroBatches(2), 1);
  EXPECT_NE(plan.note.find("a step's 4 micro-batches of 8 (4 ranks x --grad_accum=1) split "
                           "unevenly: rank 0 accumulate(s) 2 a step and ranks 1-2 1 and a pass "
                           "without data"),
            std::string::npos)
      << plan.note;
  EXPECT_NE(plan.note.find("the global batch stays 32 samples"), std::string::npos) << plan.note;
  // 800 -> 792 ranks at A = 1: 8 ranks take two, 784 one.
  BatchLayout big = PlanGlobalBatch(true, 800, 792, 1, 8).layout;
  int two = 0, one = 0;
  for (int r = 0; r < 792; ++r) {
    (big.DataMicroBatches(r) == 2 ? two : one) += 1;
    EXPECT_GE(big.DataMicroBatches(r), 1);
  }
  EXPECT_EQ(two, 8);
  EXPECT_EQ(one, 784);
}

TEST(GlobalBatchTest, OffKeepsThePerRankBatch) {
  GlobalBatchPlan plan = PlanGlobalBatch(false, 4, 3, 1, 8);
  EXPECT_EQ(plan.layout.Passes(), 1);
  EXPECT_EQ(plan.layout.data_world, 3);
  EXPECT_FALSE(plan.kept);
  EXPECT_NE(plan.note.find("--keep_global_batch=false"), std::string::npos) << plan.note;
  EXPECT_NE(plan.note.find("from 32 to 24 samples"), std::string::npos) << plan.note;
}

TEST(GlobalBatchTest, ABadLayoutIsRefusedByName) {
  EXPECT_TRUE(BatchLayout({3, 4, 1}).Check().ok());
  absl::Status s = BatchLayout({0, 4, 1}).Check();
  EXPECT_TRUE(absl::IsInvalidArgument(s));
  EXPECT_NE(s.message().find("0 rank(s) taking the micro-batches of 4 rank(s) x 1"),
            std::string::npos)
      << s;
}

// The property the worker relies on: at every world size below the
// original, divisible or not, a step's micro-batches over all survivors are
// exactly the original step's rows, each once; each survivor takes them in
// increasing order; and survivor r''s micro-batch m' is original micro-batch
// k = m' W' + r' (original rank k mod W0, micro k / W0).
TEST(GlobalBatchTest, TheShrunkStepTakesTheOriginalStepsRowsInTheOriginalOrder) {
  const int batch = 4;
  for (int original : {2, 3, 4, 5}) {
    for (int accum : {1, 2, 3}) {
      for (int world = 1; world < original; ++world) {
        const BatchLayout layout = PlanGlobalBatch(true, original, world, accum, batch).layout;
        ASSERT_TRUE(layout.Check().ok());
        for (int64_t step : {0, 1, 7}) {
          std::vector<int64_t> want, got;
          for (int m = 0; m < accum; ++m) {
            for (int r = 0; r < original; ++r) {
              want.push_back(*MicroBatchStartRow(step, m, r, original, batch, accum));
            }
          }
          int total = 0;
          for (int r = 0; r < world; ++r) {
            int64_t previous = -1;
            const int mine = layout.DataMicroBatches(r);
            EXPECT_TRUE(mine == layout.Passes() || mine == layout.Passes() - 1);
            for (int m = 0; m < mine; ++m) {
              const BatchLayout::Coordinates at = layout.At(r, m);
              const int64_t row =
                  *MicroBatchStartRow(step, at.micro, at.rank, original, batch, accum);
              EXPECT_GT(row, previous) << "rank " << r << " micro " << m;
              previous = row;
              const int k = m * world + r;
              EXPECT_EQ(row, want[k]) << original << " -> " << world << ", A " << accum;
              got.push_back(row);
              ++total;
            }
          }
          EXPECT_EQ(total, original * accum);
          std::sort(got.begin(), got.end());
          EXPECT_EQ(got, want) << original << " -> " << world << ", A " << accum << ", step "
                               << step;
          // Even shrinks: the same rows as the layout at (world, N / world).
          if (!layout.Even()) continue;
          for (int r = 0; r < world; ++r) {
            for (int m = 0; m < layout.Passes(); ++m) {
              const BatchLayout::Coordinates at = layout.At(r, m);
              EXPECT_EQ(*MicroBatchStartRow(step, m, r, world, batch, layout.Passes()),
                        *MicroBatchStartRow(step, at.micro, at.rank, original, batch, accum));
            }
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace zeroshard
