// A worker host cut off silently (no FIN, no RST), W = 4 as 2 hosts x 2
// ranks: what the launcher does about it, each run ending with its final
// parameters compared bitwise to an uninterrupted run of the same world sizes.
//   - Replace: the cut-off host's processes are gone for good; replacements
//     with their worker ids start (on a host at the same address) and the job
//     goes on at W = 4 from the in-memory snapshot.
//   - Shrink, then grow back: with --min_world_size=2 the other host's ranks
//     go on alone after --rejoin_grace; replacements started later are
//     admitted at the members' next committed snapshot and the job returns to
//     W = 4. Reference: W = 4 to the shrink's snapshot, W = 2 to the grow's,
//     W = 4 to the end (disk checkpoints between, --resume=latest).
#include <signal.h>

#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "tests/cluster/across_hosts.h"

namespace zeroshard::testing {
namespace {

using ElasticTest = AcrossHostsTest;

constexpr int kSteps = 100;

// Host 2 (w2, w3) vanishes; its processes are killed where they stand (they
// cannot say goodbye) and the network comes back for their replacements.
void CutHostTwoAndKillItsRanks(EmulatedHosts& hosts, LocalCluster& cluster) {
  ASSERT_TRUE(hosts.CutOff(2).ok());
  for (int r : {2, 3}) cluster.worker(r)->Signal(SIGKILL);
}

double SecondsBetweenUnixMs(int64_t from_ms, int64_t to_ms) { return (to_ms - from_ms) / 1000.0; }

TEST_F(ElasticTest, ACutOffHostReplacedByTheLauncherKeepsWorldSizeFour) {
  ASSERT_TRUE(StartCluster());
  const Params reference = Reference(kSteps);
  ASSERT_FALSE(reference.empty());
  cluster_->StartWorkers("replace", 4, Flags(Recoverable(kSteps, {})));
  ASSERT_TRUE(WaitForStep(25));
  const int64_t cut_ms = absl::ToUnixMillis(absl::Now());
  CutHostTwoAndKillItsRanks(*hosts_, *cluster_);
  // The server declares them dead by their silence (heartbeat timeout
  // 1.5 s); the replacements start once it did, as a launcher's would.
  ASSERT_TRUE(
      WaitFor([&] { return !ServerEvents("member_dead", absl::FromUnixMillis(cut_ms)).empty(); },
              absl::Seconds(30)))
      << cluster_->server()->Log();
  ASSERT_TRUE(hosts_->HealAll().ok());
  cluster_->RestartWorker(2);
  cluster_->RestartWorker(3);
  ASSERT_TRUE(AllExitZero(absl::Seconds(120)));
  const nlohmann::json report = cluster_->Report("replace", 0);
  ASSERT_GE(report["recoveries"].size(), 1u) << report.dump();
  const nlohmann::json& recovery = report["recoveries"][0];
  EXPECT_EQ(recovery["source"], "snapshot") << report.dump();
  EXPECT_EQ(recovery["world_size"], 4) << report.dump();
  std::fprintf(stderr,
               "replace: restored step %d; rank 0 trained again %.2f s after the cut "
               "(replacements started after the server's verdict)\n",
               recovery["restored_step"].get<int>(),
               SecondsBetweenUnixMs(cut_ms, recovery["first_step_unix_ms"].get<int64_t>()));
  ExpectEqual(Final("replace", kSteps), reference, "host cut off, replaced");
}

TEST_F(ElasticTest, ShrinksWithoutTheCutOffHostThenGrowsBackToFour) {
  ASSERT_TRUE(StartCluster());
  // The world sizes' arithmetic, each against its own reference: the per-rank
  // batch kept through the shrink (#45's --keep_global_batch off).
  const std::vector<std::string> elastic = {"--min_world_size=2", "--rejoin_grace=2s",
                                            "--keep_global_batch=false"};
  cluster_->StartWorkers("grow", 4, Flags(Recoverable(kSteps, elastic)));
  ASSERT_TRUE(WaitForStep(25));
  const int64_t cut_ms = absl::ToUnixMillis(absl::Now());
  CutHostTwoAndKillItsRanks(*hosts_, *cluster_);
  // Shrunk: rank 0 trains again at W = 2.
  ASSERT_TRUE(
      WaitFor([&] { return cluster_->WorkerLog(0).find("at world size 2") != std::string::npos; },
              absl::Seconds(60)))
      << cluster_->WorkerLog(0) << cluster_->server()->Log();
  const int shrunk_at = LatestStep();
  ASSERT_TRUE(WaitForStep(shrunk_at + 5));  // some steps at W = 2
  ASSERT_TRUE(hosts_->HealAll().ok());
  const int64_t growers_ms = absl::ToUnixMillis(absl::Now());
  cluster_->RestartWorker(2);
  cluster_->RestartWorker(3);
  ASSERT_TRUE(AllExitZero(absl::Seconds(120)));
  const std::string server_log = cluster_->server()->Log();
  EXPECT_NE(server_log.find("event=grow_back "), std::string::npos) << server_log;
  EXPECT_EQ(server_log.find("RESOURCE_EXHAUSTED"), std::string::npos) << server_log;

  const nlohmann::json report = cluster_->Report("grow", 0);
  ASSERT_EQ(report["recoveries"].size(), 2u) << report.dump();
  const nlohmann::json& shrink = report["recoveries"][0];
  const nlohmann::json& grow = report["recoveries"][1];
  EXPECT_EQ(shrink["world_size"], 2) << report.dump();
  EXPECT_EQ(shrink["source"], "snapshot") << report.dump();
  EXPECT_EQ(grow["world_size"], 4) << report.dump();
  EXPECT_EQ(grow["source"], "snapshot") << report.dump();
  EXPECT_EQ(report["world_size"], 4) << report.dump();
  const int shrink_step = shrink["restored_step"];
  const int grow_step = grow["restored_step"];
  EXPECT_EQ(shrink_step % 10, 0);
  EXPECT_EQ(grow_step % 10, 0);
  ASSERT_LT(shrink_step, grow_step);
  std::fprintf(stderr,
               "shrink: restored step %d, rank 0 trained again %.2f s after the cut (grace 2 s); "
               "grow back: restored step %d, at W = 4 %.2f s after the replacements started\n",
               shrink_step, SecondsBetweenUnixMs(cut_ms, shrink["first_step_unix_ms"]), grow_step,
               SecondsBetweenUnixMs(growers_ms, grow["first_step_unix_ms"]));

  // Reference: the same world sizes over the same steps, without failures.
  ASSERT_TRUE(cluster_->Run("grow-ref", 4,
                            Flags({absl::StrCat("--steps=", shrink_step), "--snapshot_every=0"})));
  ASSERT_TRUE(cluster_->Run(
      "grow-ref", 2,
      Flags({absl::StrCat("--steps=", grow_step), "--snapshot_every=0", "--resume=latest"})));
  ASSERT_TRUE(cluster_->Run(
      "grow-ref", 4,
      Flags({absl::StrCat("--steps=", kSteps), "--snapshot_every=0", "--resume=latest"})));
  ExpectEqual(Final("grow", kSteps), Final("grow-ref", kSteps), "shrunk to 2, grown back to 4");
}

}  // namespace
}  // namespace zeroshard::testing
