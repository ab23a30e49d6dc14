// WorkerTimeLedger (worker/time_ledger.h): the partition of a worker's wall
// clock into causes, with the times given (no sleeping).
#include "worker/time_ledger.h"

#include <cmath>
#include <thread>
#include <vector>

#include "absl/time/time.h"
#include "gtest/gtest.h"

namespace zeroshard {
namespace {

const absl::Time kT0 = absl::FromUnixSeconds(1'700'000'000);

absl::Time At(double seconds) { return kT0 + absl::Seconds(seconds); }

double Sum(const v1::TimeLedger& t) {
  return t.startup() + t.restore() + t.productive() + t.data_wait() + t.checkpoint_pause() +
         t.snapshot_pause() + t.lost_work() + t.stall() + t.straggler() + t.evaluation() +
         t.other();
}

// Sums of a few doubles: exact to a few ulps of the total.
constexpr double kExact = 1e-9;

// A step of `seconds` starting where the last one ended (`*now`), with the
// given arrival spread.
StepTiming NextStep(int64_t step, double* now, double seconds, double spread = 0) {
  StepTiming t;
  t.step = step;
  t.start = At(*now);
  t.end = At(*now + seconds);
  t.arrival_spread = spread;
  t.items = 64;
  *now += seconds;
  return t;
}

// Five regular steps of 1 s from `*now`: the median is known from then on.
void Warm(WorkerTimeLedger& ledger, double* now, int64_t* step) {
  for (int i = 0; i < WorkerTimeLedger::kMinWindow; ++i) ledger.Step(NextStep((*step)++, now, 1.0));
}

// A server that does not tell the job's steps (steps_done 0): the steps this
// process completed before the failure are still lost when trained again.
TEST(GoodputLedgerTest, ASurvivorsOwnStepsMarkItsReRunsLost) {
  WorkerTimeLedger ledger;
  ledger.StartGeneration(At(0), false, 0, 2);
  double now = 0;
  for (int64_t s = 0; s < 4; ++s) ledger.Step(NextStep(s, &now, 1.0));
  ledger.EndGeneration(At(now));
  ledger.StartGeneration(At(now + 1), true, /*steps_done=*/0, 2);
  now += 1;
  ledger.Step(NextStep(2, &now, 1.0));  // back to the snapshot of step 2
  ledger.Step(NextStep(3, &now, 1.0));
  ledger.Step(NextStep(4, &now, 1.0));
  EXPECT_NEAR(ledger.Generation().lost_work(), 2.0, kExact);
  EXPECT_NEAR(ledger.Generation().productive(), 1.0, kExact);
}

TEST(GoodputLedgerTest, SetupThenStepsThenOther) {
  WorkerTimeLedger ledger;
  ledger.StartGeneration(At(0), /*recovery=*/false, /*steps_done=*/0, /*world_size=*/2);
  double now = 3;  // 3 s of plan, data plane, initial state
  ledger.Step(NextStep(0, &now, 1.0));
  ledger.Between(At(4.5));  // logging, integrity checks
  ledger.Account(At(5.0), TimeCause::kEvaluation);
  const v1::TimeLedger t = ledger.Generation();
  EXPECT_NEAR(t.startup(), 3.0, kExact);
  EXPECT_NEAR(t.productive(), 1.0, kExact);
  EXPECT_NEAR(t.other(), 0.5, kExact);
  EXPECT_NEAR(t.evaluation(), 0.5, kExact);
  EXPECT_EQ(t.restore(), 0);
  EXPECT_NEAR(Sum(t), 5.0, kExact);
  EXPECT_EQ(ledger.steps_completed(), 1);
}

TEST(GoodputLedgerTest, RecoveryGenerationIsRestoreAndRecomputedStepsAreLost) {
  WorkerTimeLedger ledger;
  ledger.StartGeneration(At(0), /*recovery=*/true, /*steps_done=*/12, 2);
  double now = 2;
  ledger.Step(NextStep(10, &now, 1.0));  // snapshot at 10: steps 10, 11 trained again
  ledger.Step(NextStep(11, &now, 1.0));
  ledger.Step(NextStep(12, &now, 1.0));  // new work
  const v1::TimeLedger t = ledger.Generation();
  EXPECT_NEAR(t.restore(), 2.0, kExact);
  EXPECT_EQ(t.startup(), 0);
  EXPECT_NEAR(t.lost_work(), 2.0, kExact);
  EXPECT_NEAR(t.productive(), 1.0, kExact);
  EXPECT_NEAR(Sum(t), 5.0, kExact);
}

TEST(GoodputLedgerTest, WaitsInsideAStepAreTheirCausesNotItsCompute) {
  WorkerTimeLedger ledger;
  ledger.StartGeneration(At(0), false, 0, 2);
  double now = 0;
  StepTiming t = NextStep(0, &now, 1.0);
  t.data_wait = 0.1;
  t.checkpoint_wait = 0.2;
  t.snapshot_wait = 0.3;
  ledger.Step(t);
  const v1::TimeLedger l = ledger.Generation();
  EXPECT_NEAR(l.data_wait(), 0.1, kExact);
  EXPECT_NEAR(l.checkpoint_pause(), 0.2, kExact);
  EXPECT_NEAR(l.snapshot_pause(), 0.3, kExact);
  EXPECT_NEAR(l.productive(), 0.4, kExact);
  EXPECT_NEAR(Sum(l), 1.0, kExact);
}

TEST(GoodputLedgerTest, WaitsLongerThanTheStepNeverCountTwice) {
  WorkerTimeLedger ledger;
  ledger.StartGeneration(At(0), false, 0, 2);
  double now = 0;
  StepTiming t = NextStep(0, &now, 1.0);
  t.data_wait = 0.7;
  t.checkpoint_wait = 0.7;  // only 0.3 s of the step are left for it
  ledger.Step(t);
  const v1::TimeLedger l = ledger.Generation();
  EXPECT_NEAR(l.checkpoint_pause(), 0.3, kExact);
  EXPECT_EQ(l.productive(), 0);
  EXPECT_NEAR(Sum(l), 1.0, kExact);
}

TEST(GoodputLedgerTest, ALateRankMakesTheExcessAStraggler) {
  WorkerTimeLedger ledger;
  ledger.StartGeneration(At(0), false, 0, 2);
  double now = 0;
  int64_t step = 0;
  Warm(ledger, &now, &step);
  // 1.8 s where the median is 1 s, a rank 0.5 s late: 0.5 s straggler, the
  // remaining 1.3 s is under 2x the median (no stall).
  ledger.Step(NextStep(step++, &now, 1.8, /*spread=*/0.5));
  // A late rank explains all of the excess when the spread covers it.
  ledger.Step(NextStep(step++, &now, 1.4, /*spread=*/2.0));
  const v1::TimeLedger t = ledger.Generation();
  EXPECT_NEAR(t.straggler(), 0.5 + 0.4, kExact);
  EXPECT_EQ(t.stall(), 0);
  EXPECT_NEAR(t.productive(), 5.0 + 1.3 + 1.0, kExact);
  EXPECT_NEAR(Sum(t), now, kExact);
}

TEST(GoodputLedgerTest, AStepOverTwiceTheMedianWithNoLateRankStalled) {
  WorkerTimeLedger ledger;
  ledger.StartGeneration(At(0), false, 0, 2);
  double now = 0;
  int64_t step = 0;
  Warm(ledger, &now, &step);
  ledger.Step(NextStep(step++, &now, 3.5));  // 2.5 s above the median
  ledger.Step(NextStep(step++, &now, 1.9));  // under 2x: jitter, productive
  const v1::TimeLedger t = ledger.Generation();
  EXPECT_NEAR(t.stall(), 2.5, kExact);
  EXPECT_EQ(t.straggler(), 0);
  EXPECT_NEAR(t.productive(), 5.0 + 1.0 + 1.9, kExact);
  EXPECT_NEAR(Sum(t), now, kExact);
}

TEST(GoodputLedgerTest, StragglerFirstThenStallForWhatTheSpreadDoesNotExplain) {
  WorkerTimeLedger ledger;
  ledger.StartGeneration(At(0), false, 0, 2);
  double now = 0;
  int64_t step = 0;
  Warm(ledger, &now, &step);
  // 5 s: 1 s of it a late rank's; the other 4 s are over 2x the median.
  ledger.Step(NextStep(step++, &now, 5.0, /*spread=*/1.0));
  const v1::TimeLedger t = ledger.Generation();
  EXPECT_NEAR(t.straggler(), 1.0, kExact);
  EXPECT_NEAR(t.stall(), 3.0, kExact);
  EXPECT_NEAR(t.productive(), 5.0 + 1.0, kExact);
}

TEST(GoodputLedgerTest, NoJudgementBeforeTheWindowHasItsSteps) {
  WorkerTimeLedger ledger;
  ledger.StartGeneration(At(0), false, 0, 2);
  double now = 0;
  ledger.Step(NextStep(0, &now, 1.0));
  ledger.Step(NextStep(1, &now, 10.0));  // the first steps warm up: not a stall
  EXPECT_NEAR(ledger.Generation().productive(), 11.0, kExact);
  EXPECT_EQ(ledger.Generation().stall(), 0);
}

TEST(GoodputLedgerTest, ARewindLosesTheBadStepItselfAndTheReRuns) {
  WorkerTimeLedger ledger;
  ledger.StartGeneration(At(0), false, 0, 2);
  double now = 0;
  for (int64_t s = 0; s < 8; ++s) ledger.Step(NextStep(s, &now, 1.0));
  StepTiming bad = NextStep(8, &now, 1.0);
  bad.applied = false;  // a loss spike: not applied, rewound
  bad.rewound = true;
  ledger.Step(bad);
  ledger.Rewound(At(now + 0.5), /*bad_step=*/8);  // back to the snapshot of step 5
  now += 0.5;
  for (int64_t s = 5; s < 10; ++s) ledger.Step(NextStep(s, &now, 1.0));
  const v1::TimeLedger t = ledger.Generation();
  // Lost: the bad step (1 s), the rewind (0.5 s), steps 5, 6, 7 again (3 s).
  EXPECT_NEAR(t.lost_work(), 4.5, kExact);
  EXPECT_NEAR(t.productive(), 8.0 + 2.0, kExact);  // 0-7, then 8 and 9
  EXPECT_NEAR(Sum(t), now, kExact);
  EXPECT_EQ(ledger.steps_completed(), 10);
}

TEST(GoodputLedgerTest, ASkippedStepIsLostButCompleted) {
  WorkerTimeLedger ledger;
  ledger.StartGeneration(At(0), false, 0, 2);
  double now = 0;
  StepTiming skipped = NextStep(0, &now, 1.0);
  skipped.applied = false;  // --on_nonfinite=skip: not applied, not re-run
  ledger.Step(skipped);
  EXPECT_NEAR(ledger.Generation().lost_work(), 1.0, kExact);
  EXPECT_EQ(ledger.Generation().model_flops(), 0);
  EXPECT_EQ(ledger.steps_completed(), 1);
}

TEST(GoodputLedgerTest, MfuCountsProductiveStepsOnly) {
  WorkerTimeLedger ledger;
  ledger.SetFlops(/*flops_per_item=*/1e6, /*peak_flops=*/1e9);
  ledger.StartGeneration(At(0), false, /*steps_done=*/1, /*world_size=*/4);
  double now = 0;
  ledger.Step(NextStep(0, &now, 1.0));  // lost (below steps_done): no FLOPs
  StepTiming t = NextStep(1, &now, 0.5);
  t.items = 100;
  t.data_wait = 0.1;
  ledger.Step(t);
  const v1::TimeLedger l = ledger.Generation();
  EXPECT_DOUBLE_EQ(l.model_flops(), 1e6 * 100);
  // 0.4 productive seconds x 4 ranks x 1e9 FLOP/s.
  EXPECT_NEAR(l.peak_flop_budget(), 0.4 * 4 * 1e9, 1e-3);
  EXPECT_EQ(l.peak_flops(), 1e9);
  EXPECT_EQ(l.flops_per_item(), 1e6);
}

TEST(GoodputLedgerTest, GenerationsSumIntoTheProcessAndTheGapIsBetween) {
  WorkerTimeLedger ledger;
  ledger.StartGeneration(At(0), false, 0, 2);
  double now = 1;
  ledger.Step(NextStep(0, &now, 1.0));          // 1 s startup, 1 s productive
  ledger.EndGeneration(At(2.5));                // the step in flight: 0.5 s lost
  ledger.StartGeneration(At(4.0), true, 1, 2);  // 1.5 s re-joining
  EXPECT_EQ(Sum(ledger.Generation()), 0);       // a new generation starts empty
  now = 5;
  ledger.Step(NextStep(1, &now, 1.0));  // 1 s restore, 1 s productive
  const v1::TimeLedger p = ledger.Process();
  EXPECT_NEAR(p.startup(), 1.0, kExact);
  EXPECT_NEAR(p.restore(), 1.0, kExact);
  EXPECT_NEAR(p.productive(), 2.0, kExact);
  EXPECT_NEAR(p.lost_work(), 0.5, kExact);
  EXPECT_NEAR(ledger.between_generations(), 1.5, kExact);
  // Partition: the process's causes and the gap cover the first join answer
  // to the cursor.
  EXPECT_NEAR(Sum(p) + ledger.between_generations(),
              absl::ToDoubleSeconds(ledger.cursor() - ledger.first_join_answer()), kExact);
}

TEST(GoodputLedgerTest, NothingIsCountedBeforeAGenerationOrBackwards) {
  WorkerTimeLedger ledger;
  ledger.Account(At(5), TimeCause::kOther);  // no generation yet
  EXPECT_EQ(Sum(ledger.Process()), 0);
  ledger.StartGeneration(At(10), false, 0, 2);
  ledger.Account(At(9), TimeCause::kOther);  // before the cursor
  EXPECT_EQ(Sum(ledger.Generation()), 0);
}

// The heartbeat thread reads while the training thread accounts: every read
// is a consistent partition (the sum is the cursor's distance, never torn).
TEST(GoodputLedgerTest, ReadsFromAnotherThreadSeeWholeUpdates) {
  WorkerTimeLedger ledger;
  ledger.StartGeneration(At(0), false, 0, 2);
  std::thread writer([&ledger] {
    double now = 0;
    for (int64_t s = 0; s < 2000; ++s) {
      StepTiming t = NextStep(s, &now, 0.25);
      t.data_wait = 0.125;
      ledger.Step(t);
    }
  });
  for (int i = 0; i < 2000; ++i) {
    const double sum = Sum(ledger.Generation());
    // Each step adds exactly 0.25 s (binary fractions: exact sums).
    EXPECT_EQ(std::fmod(sum, 0.25), 0.0) << sum;
  }
  writer.join();
  EXPECT_EQ(Sum(ledger.Generation()), 500.0);
}

}  // namespace
}  // namespace zeroshard
