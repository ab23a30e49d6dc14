// The server's goodput ledger (shard_server/goodput/goodput_ledger.h): the
// wall clock partitioned into phases and causes, at times the test chooses.
#include "shard_server/goodput/goodput_ledger.h"

#include <cmath>
#include <string>

#include "absl/time/time.h"
#include "gtest/gtest.h"

namespace zeroshard {
namespace {

// Error model of the sums below: a snapshot adds at most 15 causes and a
// split multiplies each by one scale; every value is under 1e4 s, so each
// operation rounds by at most 1e4 x 2^-52 ~ 2.2e-12 s and the ~30 of them
// stay under 1e-10 s. 1e-9 s leaves a factor of ten.
constexpr double kEps = 1e-9;

const absl::Time t0 = absl::FromUnixSeconds(1'800'000'000);
absl::Time At(double seconds) { return t0 + absl::Seconds(seconds); }

double Cause(const v1::Goodput& g, const std::string& cause) {
  if (cause == "productive") return g.productive_seconds();
  auto it = g.badput_seconds().find(cause);
  return it == g.badput_seconds().end() ? -1 : it->second;
}

double Sum(const v1::Goodput& g) {
  double sum = g.productive_seconds();
  for (const auto& [cause, seconds] : g.badput_seconds()) sum += seconds;
  return sum;
}

v1::TimeLedger Ledger(double startup, double productive, double data_wait = 0) {
  v1::TimeLedger l;
  l.set_startup(startup);
  l.set_productive(productive);
  l.set_data_wait(data_wait);
  return l;
}

TEST(GoodputLedgerTest, PhasesPartitionTheWallClockWhileTheJobRuns) {
  GoodputLedger l;
  l.Started(At(0));
  v1::Goodput g = l.Snapshot(At(1.5));
  EXPECT_NEAR(g.wall_seconds(), 1.5, kEps);
  EXPECT_NEAR(Cause(g, "rendezvous"), 1.5, kEps);
  EXPECT_EQ(g.mfu(), -1);
  l.Formed(1, At(2));
  EXPECT_TRUE(l.Report(1, 0, Ledger(0.5, 3.0, 0.25)));
  g = l.Snapshot(At(6));
  EXPECT_NEAR(g.wall_seconds(), 6, kEps);
  EXPECT_NEAR(Sum(g), 6, kEps);
  EXPECT_NEAR(Cause(g, "rendezvous"), 2, kEps);
  EXPECT_NEAR(Cause(g, "startup"), 0.5, kEps);
  EXPECT_NEAR(g.productive_seconds(), 3, kEps);
  EXPECT_NEAR(Cause(g, "data_wait"), 0.25, kEps);
  // Running 4 s, 3.75 s reported: the rest is the step in progress.
  EXPECT_NEAR(Cause(g, "in_flight"), 0.25, kEps);
  EXPECT_NEAR(g.goodput(), 3.0 / 6, kEps);
  // Every cause is listed, the ones without time too.
  EXPECT_EQ(g.badput_seconds_size(), GoodputLedger::kCauseCount - 1);
  EXPECT_EQ(Cause(g, "detection"), 0);
}

TEST(GoodputLedgerTest, TheLowestRanksLatestLedgerIsKeptOfTheRunningGenerationOnly) {
  GoodputLedger l;
  l.Started(At(0));
  l.Formed(3, At(1));
  EXPECT_TRUE(l.Report(3, 1, Ledger(0, 4)));
  EXPECT_FALSE(l.Report(3, 1, Ledger(0, 3.5)));  // an older beat of the same rank
  EXPECT_FALSE(l.Report(3, 2, Ledger(0, 5)));    // a higher rank: the ledger stays rank 1's
  EXPECT_TRUE(l.Report(3, 0, Ledger(0, 3.8)));   // a lower rank: its ledger from now on
  EXPECT_FALSE(l.Report(3, 1, Ledger(0, 4.5)));
  EXPECT_FALSE(l.Report(2, 0, Ledger(0, 9)));   // a survivor of the last generation
  EXPECT_FALSE(l.Report(3, 0, Ledger(-1, 6)));  // negative: ignored
  EXPECT_FALSE(l.Report(3, 0, Ledger(0, std::nan(""))));
  EXPECT_NEAR(l.Snapshot(At(10)).productive_seconds(), 3.8, kEps);
  // The ledger rank is kept across a save and a restore.
  absl::StatusOr<GoodputLedger> restored = GoodputLedger::FromState(l.State());
  ASSERT_TRUE(restored.ok()) << restored.status();
  EXPECT_FALSE(restored->Report(3, 1, Ledger(0, 6)));
  EXPECT_TRUE(restored->Report(3, 0, Ledger(0, 5)));
}

// A rank killed at t = 10 (its stream closed then), the verdict at 13, the
// next generation formed at 15: running to 10 (the step in flight lost),
// detection 3 s, reforming 2 s.
TEST(GoodputLedgerTest, ADeathIsSplitIntoLostWorkDetectionAndReforming) {
  GoodputLedger l;
  l.Started(At(0));
  l.Formed(1, At(2));
  l.Report(1, 0, Ledger(1, 6));  // 7 s of the 8 s to the death
  l.GenerationEnded(/*evidence=*/At(10), /*verdict=*/At(13));
  EXPECT_EQ(l.phase(), GoodputLedger::Phase::kReforming);
  EXPECT_FALSE(l.Report(1, 0, Ledger(1, 7)));  // too late: that segment is closed
  v1::Goodput g = l.Snapshot(At(14));
  EXPECT_NEAR(Cause(g, "reforming"), 1, kEps);
  l.Formed(2, At(15));
  g = l.Snapshot(At(15));
  EXPECT_NEAR(g.wall_seconds(), 15, kEps);
  EXPECT_NEAR(Sum(g), 15, kEps);
  EXPECT_NEAR(Cause(g, "rendezvous"), 2, kEps);
  EXPECT_NEAR(g.productive_seconds(), 6, kEps);
  EXPECT_NEAR(Cause(g, "startup"), 1, kEps);
  EXPECT_NEAR(Cause(g, "lost_work"), 1, kEps);
  EXPECT_NEAR(Cause(g, "detection"), 3, kEps);
  EXPECT_NEAR(Cause(g, "reforming"), 2, kEps);
  EXPECT_NEAR(Cause(g, "in_flight"), 0, kEps);
}

// A member that went silent: its last beat at 9 is earlier than what the
// survivors' ledger proves the job ran (to 2 + 7.5 = 9.5): running lasts
// until then, and detection is the rest to the verdict.
TEST(GoodputLedgerTest, RunningLastsAsLongAsTheKeptLedgerCovers) {
  GoodputLedger l;
  l.Started(At(0));
  l.Formed(1, At(2));
  l.Report(1, 0, Ledger(0.5, 7));
  l.GenerationEnded(At(9), At(12));
  v1::Goodput g = l.Snapshot(At(12));
  EXPECT_NEAR(Cause(g, "detection"), 2.5, kEps);
  EXPECT_NEAR(Cause(g, "lost_work"), 0, kEps);
  EXPECT_NEAR(Sum(g), 12, kEps);
  // A verdict with no death (a re-join, a grow back): no detection.
  l.Formed(2, At(13));
  l.Report(2, 0, Ledger(0, 1));
  l.GenerationEnded(At(14), At(14));
  g = l.Snapshot(At(14));
  EXPECT_NEAR(Cause(g, "detection"), 2.5, kEps);
  EXPECT_NEAR(Cause(g, "lost_work"), 0, kEps);
  EXPECT_NEAR(Cause(g, "reforming"), 1, kEps);
}

// Clocks of the machines disagree: a ledger that sums more than its segment
// is scaled down to it, so the causes still sum to the wall clock.
TEST(GoodputLedgerTest, ALedgerLongerThanItsSegmentIsScaledDown) {
  GoodputLedger l;
  l.Started(At(0));
  l.Formed(1, At(0));
  v1::TimeLedger ledger = Ledger(2, 8);
  ledger.set_model_flops(4e12);
  ledger.set_peak_flop_budget(8e12);
  l.Report(1, 0, ledger);
  v1::Goodput g = l.Snapshot(At(5));
  EXPECT_NEAR(Cause(g, "startup"), 1, kEps);
  EXPECT_NEAR(g.productive_seconds(), 4, kEps);
  EXPECT_NEAR(Cause(g, "in_flight"), 0, kEps);
  EXPECT_NEAR(Sum(g), 5, kEps);
  EXPECT_NEAR(g.mfu(), 0.5, kEps);
}

TEST(GoodputLedgerTest, TheClockStopsWhileFinishedAndARestartResumesIt) {
  GoodputLedger l;
  l.Started(At(0));
  l.Formed(1, At(1));
  l.StepsCompleted(40);
  l.Report(1, 0, Ledger(0.5, 8));  // a leave's final ledger: to 9.5
  l.Finished(At(10));
  EXPECT_EQ(l.phase(), GoodputLedger::Phase::kNone);
  v1::Goodput g = l.Snapshot(At(100));
  EXPECT_NEAR(g.wall_seconds(), 10, kEps);
  EXPECT_NEAR(Cause(g, "other"), 0.5, kEps);  // after the last report
  EXPECT_NEAR(Cause(g, "in_flight"), 0, kEps);
  EXPECT_EQ(l.steps_done(), 40);
  l.Started(At(200));            // the job restarted
  EXPECT_EQ(l.steps_done(), 0);  // a new run: its steps are not re-computed
  l.Formed(2, At(203));
  g = l.Snapshot(At(204));
  EXPECT_NEAR(g.wall_seconds(), 14, kEps);
  EXPECT_NEAR(Cause(g, "rendezvous"), 1 + 3, kEps);
  EXPECT_NEAR(Cause(g, "in_flight"), 1, kEps);
}

TEST(GoodputLedgerTest, StepsDoneIsTheMostReported) {
  GoodputLedger l;
  EXPECT_TRUE(l.StepsCompleted(5));
  EXPECT_FALSE(l.StepsCompleted(3));  // a rewind, or a rank behind
  EXPECT_TRUE(l.StepsCompleted(7));
  EXPECT_EQ(l.steps_done(), 7);
}

// A restarted server's ledger is the saved one: the same totals, and the
// open phase goes on from where it was saved.
TEST(GoodputLedgerTest, ASavedLedgerRestoresItsTotalsAndItsOpenPhase) {
  GoodputLedger l;
  l.Started(At(0));
  l.Formed(1, At(2));
  v1::TimeLedger ledger = Ledger(1, 6);
  ledger.set_model_flops(3e12);
  ledger.set_peak_flop_budget(1e13);
  ledger.set_peak_flops(1e12);
  l.Report(1, 0, ledger);
  l.StepsCompleted(12);
  l.GenerationEnded(At(10), At(13));
  l.Formed(2, At(15));
  l.Report(2, 0, Ledger(0.5, 2));
  l.MaybeSample(At(16));
  absl::StatusOr<GoodputLedger> restored = GoodputLedger::FromState(l.State());
  ASSERT_TRUE(restored.ok()) << restored.status();
  EXPECT_EQ(restored->phase(), GoodputLedger::Phase::kRunning);
  EXPECT_EQ(restored->generation(), 2);
  EXPECT_EQ(restored->steps_done(), 12);
  const v1::Goodput before = l.Snapshot(At(30));
  const v1::Goodput after = restored->Snapshot(At(30));
  EXPECT_EQ(before.DebugString(), after.DebugString());
  EXPECT_NEAR(after.wall_seconds(), 30, kEps);
  EXPECT_EQ(after.samples_size(), 1);
  EXPECT_NEAR(after.mfu(), 0.3, kEps);
  // The workers' cumulative ledgers cover the time the server was down.
  EXPECT_TRUE(restored->Report(2, 0, Ledger(0.5, 12)));
  EXPECT_NEAR(restored->Snapshot(At(30)).productive_seconds(), 6 + 12, kEps);
}

TEST(GoodputLedgerTest, AStateThatMakesNoSenseIsRefusedWithWhatIsWrong) {
  v1::GoodputState s;
  (*s.mutable_closed_seconds())["coffee"] = 1;
  absl::StatusOr<GoodputLedger> l = GoodputLedger::FromState(s);
  ASSERT_FALSE(l.ok());
  EXPECT_NE(l.status().message().find("unknown cause 'coffee'"), std::string::npos);
  s.clear_closed_seconds();
  s.set_phase(7);
  EXPECT_NE(GoodputLedger::FromState(s).status().message().find("unknown phase 7"),
            std::string::npos);
  s.set_phase(2);
  (*s.mutable_closed_seconds())["stall"] = -2;
  EXPECT_FALSE(GoodputLedger::FromState(s).ok());
}

// The server stopped between a job's save and its ledger's: the restored
// job's phase wins from the restore on.
TEST(GoodputLedgerTest, ReconcileMovesToTheRestoredJobsPhase) {
  GoodputLedger l;
  l.Started(At(0));
  l.Reconcile(GoodputLedger::Phase::kRunning, 4, At(3));
  EXPECT_EQ(l.phase(), GoodputLedger::Phase::kRunning);
  EXPECT_EQ(l.generation(), 4);
  l.Reconcile(GoodputLedger::Phase::kRunning, 4, At(5));  // already so: nothing
  v1::Goodput g = l.Snapshot(At(6));
  EXPECT_NEAR(Cause(g, "rendezvous"), 3, kEps);
  EXPECT_NEAR(Cause(g, "in_flight"), 3, kEps);
  l.Reconcile(GoodputLedger::Phase::kNone, 0, At(8));
  EXPECT_NEAR(l.Snapshot(At(50)).wall_seconds(), 8, kEps);
}

// Samples: one per 10 s at most, at most 64, spaced wider with age; each
// cumulative, so each one's causes sum to its wall clock.
TEST(GoodputLedgerTest, SamplesAreThinnedByTwoWithAge) {
  GoodputLedger l;
  l.Started(At(0));
  l.Formed(1, At(5));
  int added = 0;
  for (int s = 0; s <= 3600; ++s) {
    l.Report(1, 0, Ledger(0, std::max(0, s - 6)));
    added += l.MaybeSample(At(s));
  }
  EXPECT_EQ(added, 361);  // one per 10 s
  const v1::Goodput g = l.Snapshot(At(3600));
  ASSERT_LE(g.samples_size(), GoodputLedger::kMaxSamples);
  ASSERT_GE(g.samples_size(), GoodputLedger::kMaxSamples / 2);
  EXPECT_EQ(g.samples(0).unix_ms(), absl::ToUnixMillis(At(0)));  // the first is kept
  EXPECT_EQ(g.samples(g.samples_size() - 1).unix_ms(), absl::ToUnixMillis(At(3600)));
  int64_t previous_gap = INT64_MAX;
  for (int i = 1; i < g.samples_size(); ++i) {
    const v1::GoodputSample& a = g.samples(i - 1);
    const v1::GoodputSample& b = g.samples(i);
    const int64_t gap = b.unix_ms() - a.unix_ms();
    EXPECT_GE(gap, 10'000);
    EXPECT_LE(gap, previous_gap == INT64_MAX ? gap : previous_gap);  // wider with age
    previous_gap = gap;
    EXPECT_GE(b.wall_seconds(), a.wall_seconds());
    double sum = b.productive_seconds();
    for (const auto& [cause, seconds] : b.badput_seconds()) sum += seconds;
    EXPECT_NEAR(sum, b.wall_seconds(), kEps);
    EXPECT_NEAR(b.wall_seconds(), absl::ToDoubleSeconds(absl::FromUnixMillis(b.unix_ms()) - t0),
                kEps);
  }
  EXPECT_GT(g.samples(1).unix_ms() - g.samples(0).unix_ms(), 10'000);  // the oldest were thinned
}

}  // namespace
}  // namespace zeroshard
