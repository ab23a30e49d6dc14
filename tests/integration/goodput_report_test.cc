// The worker's goodput ledger (#45, docs/goodput.md "On the worker") as a
// real job writes it: a W = 2 MLP job on a real server, with disk
// checkpoints and in-memory snapshots, whose --report's "goodput" must
// account for every second of each worker from its join answer to the
// report, name the pauses the run had, and give an MFU.
#include <csignal>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/testing/cluster.h"
#include "tests/testing/process.h"
#include "tests/testing/small_mlp.h"

namespace zeroshard {
namespace {

using testing::LocalCluster;

double Sum(const std::vector<double>& values) {
  double sum = 0;
  for (double v : values) sum += v;
  return sum;
}

TEST(GoodputTest, TheReportAccountsForEveryWorkerSecondByCause) {
  LocalCluster cluster(testing::MakeTempDir("goodput"));
  ASSERT_TRUE(cluster.ok());
  testing::SmallMlp mlp;
  mlp.width = 128;  // enough compute per step for its GEMMs to register
  constexpr int kWorld = 2;
  constexpr int kSteps = 40;
  constexpr int kBatch = 8;
  // Rank 1 is told its peak; rank 0 measures its own.
  constexpr double kPeak = 5e10;
  const int64_t started_us = absl::ToUnixMicros(absl::Now());
  cluster.StartWorkers("goodput", kWorld,
                       mlp.Flags(kSteps, {"--checkpoint_every=10", "--snapshot_every=5",
                                          absl::StrCat("--batch=", kBatch), "--threads=1"}),
                       {{1, {absl::StrCat("--peak_flops=", kPeak)}}});
  const std::vector<int> codes = cluster.WaitWorkers(absl::Seconds(240));
  const int64_t ended_us = absl::ToUnixMicros(absl::Now());
  for (int r = 0; r < kWorld; ++r) ASSERT_EQ(codes[r], 0) << cluster.WorkerLog(r);
  EXPECT_NE(cluster.WorkerLog(0).find("rank 0: peak"), std::string::npos) << cluster.WorkerLog(0);

  for (int r = 0; r < kWorld; ++r) {
    SCOPED_TRACE(absl::StrCat("rank ", r));
    const nlohmann::json report = cluster.Report("goodput", r);
    ASSERT_TRUE(report.contains("goodput")) << report.dump();
    const nlohmann::json& g = report["goodput"];
    const nlohmann::json& s = g["seconds"];
    double causes = 0;
    for (const auto& seconds : s) {
      EXPECT_GE(seconds.get<double>(), 0) << g.dump();
      causes += seconds.get<double>();
    }
    // The process's times are the test's clock too (one machine): they lie
    // inside the span the test saw the workers run in.
    const int64_t join_us = g["join_answer_unix_us"];
    const int64_t until_us = g["accounted_until_unix_us"];
    const int64_t written_us = g["written_unix_us"];
    EXPECT_LE(started_us, join_us);
    EXPECT_LE(join_us, until_us);
    EXPECT_LE(until_us, written_us);
    EXPECT_LE(written_us, ended_us);
    // Error model of "the causes sum to the worker's time within 1 %": the
    // ledger partitions [join answer, accounted_until] exactly (each interval
    // starts where the last ended), so the only time it does not cover is
    // from its last update to the report's write (building the JSON: well
    // under a millisecond) -- against a run of seconds, far under 1 %. A
    // lost or double-counted interval (a wait counted in its step and as a
    // pause, a phase not accounted) breaks it.
    const double worker_seconds = (written_us - join_us) / 1e6;
    EXPECT_NEAR(causes, g["accounted_seconds"].get<double>(), 1e-9 * worker_seconds);
    EXPECT_EQ(g["between_generations_seconds"].get<double>(), 0);  // one generation
    EXPECT_NEAR(causes, worker_seconds, 0.01 * worker_seconds) << g.dump();
    // Microsecond timestamps: the partition is exact to their rounding.
    EXPECT_NEAR(causes, (until_us - join_us) / 1e6, 2e-6 + 1e-9 * worker_seconds);

    // The causes the run had. Disk checkpoints every 10 steps and at the
    // end, snapshots every 5: each pauses the training thread at least for
    // what the checkpointer and the snapshot schedule measure themselves (a
    // sub-interval of the ledger's), so the ledger's pause is no smaller.
    const double checkpoint = s["checkpoint_pause"];
    const double snapshot = s["snapshot_pause"];
    EXPECT_GT(checkpoint, 0);
    EXPECT_GT(snapshot, 0);
    EXPECT_GE(checkpoint + 1e-6, Sum(report["checkpoint_pause_ms"]) / 1e3);
    EXPECT_GE(snapshot + 1e-6, Sum(report["snapshot_pause_ms"]) / 1e3);
    EXPECT_GT(s["productive"].get<double>(), 0);
    EXPECT_GT(s["startup"].get<double>(), 0);  // plan, data plane, initial state
    EXPECT_EQ(s["restore"].get<double>(), 0);  // no recovery
    EXPECT_EQ(s["lost_work"].get<double>(), 0);
    // The steps' intervals (step_ms, the same clock readings) hold their
    // compute and data waits, plus at most the pauses' in-step parts.
    const double steps = Sum(report["step_ms"]) / 1e3;
    const double in_steps = s["productive"].get<double>() + s["stall"].get<double>() +
                            s["straggler"].get<double>() + s["data_wait"].get<double>();
    EXPECT_LE(in_steps, steps + 1e-6);
    EXPECT_GE(in_steps + checkpoint + snapshot, steps - 1e-6);

    // MFU: 6N FLOPs a row; every step productive, 8 rows a rank.
    const double per_item = g["flops_per_item"];
    EXPECT_DOUBLE_EQ(per_item, 6.0 * report["parameters"].get<double>());
    EXPECT_NEAR(g["model_flops"].get<double>(), per_item * kBatch * kWorld * kSteps,
                1e-9 * per_item * kBatch * kWorld * kSteps);
    const double peak = g["peak_flops"];
    EXPECT_EQ(g["peak_flops_source"], r == 1 ? "flag" : "measured");
    if (r == 1) {
      EXPECT_EQ(peak, kPeak);
    }
    EXPECT_GT(peak, 0);
    EXPECT_NEAR(g["peak_flop_budget"].get<double>(), s["productive"].get<double>() * kWorld * peak,
                1e-9 * g["peak_flop_budget"].get<double>());
    const double mfu = g["mfu"];
    EXPECT_GT(mfu, 0) << g.dump();
    EXPECT_LE(mfu, 1) << g.dump();
  }
}

// A rank killed after 15 steps and replaced (W = 2, snapshots every 10): the
// survivor's report covers both of its generations, the time between them,
// the restore, and the steps it trained again.
TEST(GoodputTest, ASurvivorAccountsForTheRestoreAndTheStepsTrainedAgain) {
  LocalCluster cluster(testing::MakeTempDir("goodput-recovery"),
                       {"--heartbeat_interval_ms=300", "--heartbeat_timeout_ms=1500"});
  ASSERT_TRUE(cluster.ok());
  testing::SmallMlp mlp;
  constexpr int kStepDelayMs = 50;
  constexpr int kKilledAfter = 15;
  constexpr int kSteps = 40;
  cluster.StartWorkers("recovery", 2,
                       mlp.Flags(kSteps, {"--snapshot_every=10", "--batch=8", "--threads=1",
                                          absl::StrCat("--test_step_delay_ms=", kStepDelayMs),
                                          "--rejoin_timeout=60s", "--join_timeout_s=60"}));
  ASSERT_TRUE(testing::WaitFor(
      [&] {
        return cluster.WorkerLog(0).find(absl::StrCat("step ", kKilledAfter, "/")) !=
               std::string::npos;
      },
      absl::Seconds(60)))
      << cluster.WorkerLog(0);
  cluster.worker(1)->Signal(SIGKILL);
  cluster.RestartWorker(1);
  const std::vector<int> codes = cluster.WaitWorkers(absl::Seconds(120));
  for (size_t r = 0; r < codes.size(); ++r) ASSERT_EQ(codes[r], 0) << cluster.WorkerLog(r);

  const nlohmann::json report = cluster.Report("recovery", 0);
  ASSERT_GE(report["recoveries"].size(), 1u) << report.dump();
  const nlohmann::json& g = report["goodput"];
  const nlohmann::json& s = g["seconds"];
  double causes = 0;
  for (const auto& seconds : s) causes += seconds.get<double>();
  const double between = g["between_generations_seconds"];
  // The same error model as above: the causes and the time between the
  // generations partition the worker's time up to the ledger's last update,
  // a moment before the report.
  const double worker_seconds =
      (g["written_unix_us"].get<int64_t>() - g["join_answer_unix_us"].get<int64_t>()) / 1e6;
  EXPECT_NEAR(causes + between, worker_seconds, 0.01 * worker_seconds) << g.dump();
  EXPECT_GT(between, 0) << g.dump();  // the failure seen -> the next join answer
  EXPECT_GT(s["startup"].get<double>(), 0);
  EXPECT_GT(s["restore"].get<double>(), 0);
  // Every step index trained more than once was trained again after the
  // recovery (however far the survivor got before it saw its peer die): the
  // report's step_ms has one entry per step trained, each at least the
  // --test_step_delay_ms sleep inside it (the waits inside a step are
  // outside its compute). Beyond them, the step in flight at the failure.
  const double retrained = static_cast<double>(report["step_ms"].size()) - kSteps;
  EXPECT_GE(s["lost_work"].get<double>(), retrained * kStepDelayMs / 1e3) << g.dump();
  EXPECT_GT(s["lost_work"].get<double>(), 0) << g.dump();
  EXPECT_GT(s["productive"].get<double>(), 0);
}

}  // namespace
}  // namespace zeroshard
