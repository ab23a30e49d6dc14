// Training never waits for an unreachable control plane (#51): the
// replicated control plane on hosts 0-2 (three etcd members, three shard
// servers) and a 4-worker job on hosts 3 and 4 checkpointing every 25 steps.
// First host 4 loses the leading server for 20 s (a partition: it still
// reaches its peers), then etcd loses its quorum for 20 s (two of three
// members stopped: no server can lead). Each spans checkpoints. The ranks
// keep training through both, their commits wait and go through in step
// order once a leader answers: no member declared dead (generation 1, no
// recovery), every checkpoint step complete afterwards, every worker exits
// 0, and the final checkpoint equals, bit for bit, that of the same job run
// undisturbed (the --test_step_delay_ms sleep changes no arithmetic).
#include <signal.h>

#include <algorithm>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
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
constexpr int kWidth = 32;
constexpr int kSteps = 450;  // >= 45 s at 100 ms a step: both 20-s faults and the steps between
constexpr int kEvery = 25;

std::vector<std::string> Flags(const std::vector<std::string>& extra) {
  std::vector<std::string> flags = {"--model=mlp",
                                    absl::StrCat("--layers=", kLayers),
                                    absl::StrCat("--width=", kWidth),
                                    "--seed=7",
                                    "--stage=3",
                                    absl::StrCat("--steps=", kSteps),
                                    "--batch=8",
                                    absl::StrCat("--checkpoint_every=", kEvery),
                                    "--checkpoint_at_end",
                                    "--collective_timeout=60s",
                                    // 20 s of lost quorum is 8 checkpoints at 100 ms a step, and
                                    // a loaded machine takes seconds more to elect a leader after
                                    // it: the default 8 would drop the oldest waiting (as it
                                    // should), which is not this scenario.
                                    "--max_pending_commits=32"};
  flags.insert(flags.end(), extra.begin(), extra.end());
  return flags;
}

// The latest "step N/" worker 0 has logged (0: none).
int LatestStep(const LocalCluster& workers) {
  int latest = 0;
  for (absl::string_view line : absl::StrSplit(workers.WorkerLog(0), '\n')) {
    int step = 0;
    if (absl::StartsWith(line, "step ") &&
        absl::SimpleAtoi(line.substr(5, line.find('/') - 5), &step)) {
      latest = std::max(latest, step);
    }
  }
  return latest;
}

// Worker 0's lines about checkpoints, for a failure's message.
std::string CheckpointLines(const std::string& log) {
  std::string lines;
  for (absl::string_view line : absl::StrSplit(log, '\n')) {
    if (absl::StrContains(line, "checkpoint")) absl::StrAppend(&lines, "worker 0: ", line, "\n");
  }
  return lines;
}

TEST(ControlPlaneAwayTest, APartitionAndAnEtcdQuorumLossSpanningCheckpointsCostNothing) {
  absl::StatusOr<std::unique_ptr<EmulatedHosts>> hosts = EmulatedHosts::Create(5);
  ASSERT_TRUE(hosts.ok()) << hosts.status();
  const std::string dir = MakeTempDir("control-plane-away");
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

  ASSERT_TRUE(job.Run("calm", kWorld, Flags({})));
  job.StartWorkers("away", kWorld, Flags({"--test_step_delay_ms=100"}));
  ASSERT_TRUE(WaitFor([&] { return LatestStep(job) >= 10; }, absl::Seconds(120)))
      << job.WorkerLog(0);

  // 1. Host 4 (ranks 2, 3) loses the leading server.
  ASSERT_TRUE((*hosts)->CutPair(leader, 4).ok());
  const int cut_at = LatestStep(job);
  absl::SleepFor(absl::Seconds(20));  // the partition is the scenario
  const int healed_at = LatestStep(job);
  ASSERT_TRUE((*hosts)->HealAll().ok());
  std::fprintf(stderr, "partition: rank 0 trained steps %d..%d\n", cut_at, healed_at);
  EXPECT_GE(healed_at / kEvery - cut_at / kEvery, 2) << "too few checkpoints inside the partition";
  ASSERT_TRUE(WaitFor([&] { return LatestStep(job) >= healed_at + 20; }, absl::Seconds(60)))
      << job.WorkerLog(0);

  // 2. etcd without quorum: no server can lead.
  etcd.member((leader + 1) % 3)->Signal(SIGSTOP);
  etcd.member((leader + 2) % 3)->Signal(SIGSTOP);
  const int lost_at = LatestStep(job);
  absl::SleepFor(absl::Seconds(20));
  const int back_at = LatestStep(job);
  etcd.member((leader + 1) % 3)->Signal(SIGCONT);
  etcd.member((leader + 2) % 3)->Signal(SIGCONT);
  std::fprintf(stderr, "etcd quorum lost: rank 0 trained steps %d..%d\n", lost_at, back_at);
  EXPECT_GE(back_at / kEvery - lost_at / kEvery, 2) << "too few checkpoints inside the loss";

  const std::vector<int> codes = job.WaitWorkers(absl::Seconds(240));
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_EQ(codes[r], 0) << "rank " << r << ":\n" << job.WorkerLog(r);
    const nlohmann::json report = job.Report("away", r);
    EXPECT_TRUE(report.contains("recoveries") && report["recoveries"].empty())
        << "rank " << r << " went through a recovery:\n"
        << report.dump() << "\n"
        << servers.LogLines(
               {"event=member_dead", "event=generation_bumped", "event=serving", "leadership"});
  }
  for (int step = kEvery; step <= kSteps; step += kEvery) {
    EXPECT_FALSE(
        ReadFileOrEmpty(absl::StrCat(checkpoints, "/away/step-", step, "/manifest.json")).empty())
        << "step " << step << " never committed\n"
        << CheckpointLines(job.WorkerLog(0)) << servers.LogLines(
               {"event=member_dead", "event=generation_bumped", "event=serving", "leadership"});
  }
  const Params calm =
      LoadCheckpointParams(checkpoints, "calm", kSteps, *MlpSpec(kLayers, kWidth, "none"));
  const Params got =
      LoadCheckpointParams(checkpoints, "away", kSteps, *MlpSpec(kLayers, kWidth, "none"));
  ASSERT_FALSE(calm.empty());
  EXPECT_EQ(got, calm);  // the same arithmetic in the same order: the same bits
}

}  // namespace
}  // namespace zeroshard::testing
