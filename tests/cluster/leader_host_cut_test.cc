// The replicated control plane across emulated hosts (#30): three etcd
// members and three shard servers, one of each on hosts 0-2, and a 4-worker
// job on hosts 3 and 4 (2 ranks each). The leading server's host is cut off
// silently (its packets dropped, as a dead switch port or a partition does):
// its etcd member goes with it, a quorum of two is left, and another server
// leads once the cut-off leader's lease has run out (measured and printed).
// No member is declared dead (no recovery, generation 1), every worker exits
// 0, and the final checkpoint equals, bit for bit, that of the same job run
// before the cut with nothing disturbed.
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/model_zoo.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/testing/emulated_hosts.h"
#include "tests/testing/cluster.h"
#include "tests/testing/etcd_cluster.h"
#include "tests/testing/params.h"
#include "tests/testing/process.h"

namespace zeroshard::testing {
namespace {

constexpr int kWorld = 4;
constexpr int kLayers = 3;
constexpr int kWidth = 64;
constexpr int kSteps = 300;

std::vector<std::string> Flags() {
  return {"--model=mlp",
          absl::StrCat("--layers=", kLayers),
          absl::StrCat("--width=", kWidth),
          "--seed=5",
          "--stage=3",
          absl::StrCat("--steps=", kSteps),
          "--batch=8",
          "--checkpoint_every=100",
          "--checkpoint_at_end",
          "--collective_timeout=30s"};
}

// Steps worker 0 has logged ("step N/M ...").
int LoggedSteps(const LocalCluster& workers) {
  int steps = 0;
  for (absl::string_view line : absl::StrSplit(workers.WorkerLog(0), '\n')) {
    steps += absl::StartsWith(line, "step ");
  }
  return steps;
}

TEST(LeaderHostCutTest, AnotherServerLeadsAndTheJobNeverNoticesTheCut) {
  absl::StatusOr<std::unique_ptr<EmulatedHosts>> hosts = EmulatedHosts::Create(5);
  ASSERT_TRUE(hosts.ok()) << hosts.status();
  const std::string dir = MakeTempDir("leader-host-cut");
  EtcdCluster etcd(dir + "/etcd", 3, OnHosts{hosts->get(), {0, 1, 2}});
  ASSERT_TRUE(etcd.ok());
  const std::string checkpoints = dir + "/workers/checkpoints";  // the job's checkpoint_root()
  RunCommand("mkdir -p " + checkpoints);
  ReplicatedServers servers(dir + "/servers", etcd.endpoints(),
                            {"--checkpoint_root=" + checkpoints, "--heartbeat_interval_ms=1000",
                             "--heartbeat_timeout_ms=3000"},
                            3, OnHosts{hosts->get(), {0, 1, 2}});
  LocalCluster job(ExternalServers{servers.addresses()}, dir + "/workers",
                   HostLayout{hosts->get(), -1, {3, 3, 4, 4}});
  const int leader = servers.WaitLeader(absl::Seconds(30));
  ASSERT_GE(leader, 0) << servers.Log(0);

  ASSERT_TRUE(job.Run("calm", kWorld, Flags()));
  job.StartWorkers("cut", kWorld, Flags());
  ASSERT_TRUE(WaitFor([&] { return LoggedSteps(job) >= 20; }, absl::Seconds(120)))
      << job.WorkerLog(0);

  ASSERT_TRUE((*hosts)->CutOff(leader).ok());  // host k runs server k
  const absl::Time cut = absl::Now();
  const int next = servers.WaitLeader(absl::Seconds(30), leader);
  const absl::Duration failover = absl::Now() - cut;
  ASSERT_GE(next, 0) << servers.Log((leader + 1) % 3);
  std::printf("failover: server %d's host cut off, server %d leads after %.2f s\n", leader, next,
              absl::ToDoubleSeconds(failover));
  RecordProperty("failover_ms", static_cast<int>(absl::ToInt64Milliseconds(failover)));

  const std::vector<int> codes = job.WaitWorkers(absl::Seconds(180));
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_EQ(codes[r], 0) << "rank " << r << ":\n" << job.WorkerLog(r);
    const nlohmann::json report = job.Report("cut", r);
    EXPECT_TRUE(report.contains("recoveries") && report["recoveries"].empty())
        << "rank " << r << " went through a recovery (a member was declared dead):\n"
        << report.dump() << "\n"
        << servers.LogLines({"event=member_dead", "event=generation_bumped", "event=serving"});
  }
  ASSERT_TRUE((*hosts)->HealAll().ok());
  const Params calm =
      LoadCheckpointParams(checkpoints, "calm", kSteps, *MlpSpec(kLayers, kWidth, "none"));
  const Params got =
      LoadCheckpointParams(checkpoints, "cut", kSteps, *MlpSpec(kLayers, kWidth, "none"));
  ASSERT_FALSE(calm.empty());
  EXPECT_EQ(got, calm);  // the same arithmetic in the same order: the same bits
}

}  // namespace
}  // namespace zeroshard::testing
