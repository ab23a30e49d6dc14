// HSDP recovery across emulated hosts (#25), W = 4 as 2 hosts x 2 ranks with
// --shard_group_size=host: each host's ranks shard the model, the other host
// holds the replica. Host 2's processes (ranks 2 and 3) are killed at once and
// replaced: every lost rank's state comes from its replica on host 1 (old
// rank 0 to rank 2, old rank 1 to rank 3), no buddy copy exists, and the run
// ends bitwise equal to an uninterrupted one. Manual (needs root for the
// namespaces, and ~30 s): run it by hand, docs/recovery.md quotes it.
#include <signal.h>

#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/cluster/across_hosts.h"

namespace zeroshard::testing {
namespace {

using HsdpRecoveryTest = AcrossHostsTest;

constexpr int kSteps = 60;

TEST_F(HsdpRecoveryTest, AHostsRanksLostAreRestoredFromTheReplicasOnTheOtherHost) {
  ASSERT_TRUE(StartCluster());
  const std::vector<std::string> flags = Flags(Recoverable(kSteps, {"--shard_group_size=host"}));
  ASSERT_TRUE(cluster_->Run("reference", 4, flags));
  const Params reference = Final("reference", kSteps);
  ASSERT_FALSE(reference.empty());
  cluster_->StartWorkers("replace", 4, flags);
  ASSERT_TRUE(WaitForStep(25));
  for (int r : {2, 3}) cluster_->worker(r)->Signal(SIGKILL);
  cluster_->RestartWorker(2);
  cluster_->RestartWorker(3);
  ASSERT_TRUE(AllExitZero(absl::Seconds(120)));
  const nlohmann::json report = cluster_->Report("replace", 0);
  ASSERT_GE(report["recoveries"].size(), 1u) << report.dump();
  const nlohmann::json& recovery = report["recoveries"][0];
  EXPECT_EQ(recovery["source"], "snapshot") << report.dump();
  EXPECT_EQ(recovery["transfers"], nlohmann::json::parse(R"([
      {"from": 0, "to": 2, "old_rank": 0, "kind": "replica"},
      {"from": 1, "to": 3, "old_rank": 1, "kind": "replica"}])"))
      << recovery.dump();
  EXPECT_GT(report["snapshots_from_replicas"].get<int>(), 0) << report.dump();
  std::fprintf(stderr,
               "replace: restored step %d from %s; transfers %s; restore %.0f ms, first step "
               "again %.0f ms after the failure was seen\n",
               recovery["restored_step"].get<int>(), recovery["source"].get<std::string>().c_str(),
               recovery["transfers"].dump().c_str(), recovery["restore_ms"].get<double>(),
               recovery["first_step_ms"].get<double>());
  ExpectEqual(Final("replace", kSteps), reference, "host 2 lost, restored from replicas");
}

}  // namespace
}  // namespace zeroshard::testing
