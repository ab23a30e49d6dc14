// Silent data corruption between HSDP replicas (issue #43): W = 4 in shard
// groups of 2 (ranks 1 and 3 hold the same shard), real processes.
// --testing_corrupt=1:12 flips one exponent bit of rank 1's master shard
// after step 12; --replica_check_every=5 finds it in the state after step
// 15 (compared in step 16, before its update). Without an in-memory snapshot
// every rank stops naming ranks 1 and 3; with --snapshot_every=5 every rank
// rewinds to the last snapshot the replicas vouched for (step 10's, or 5's),
// re-runs, and the re-run's check names rank 1 (its hash is the one that
// changed); the run ends bitwise equal to one without the corruption (the
// re-run starts from the snapshot's exact bits and repeats the same
// arithmetic). A second corruption on rank 1 evicts its host. Without the
// corruption the check changes nothing: the parameters equal a run without
// it, bit for bit.
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/model_zoo.h"
#include "gtest/gtest.h"
#include "tests/testing/cluster.h"
#include "tests/testing/params.h"
#include "tests/testing/process.h"

namespace zeroshard {
namespace {

using testing::LocalCluster;

constexpr int kWorld = 4;
constexpr int kSteps = 20;

std::vector<std::string> Flags(std::vector<std::string> extra) {
  std::vector<std::string> flags = {"--model=mlp",         "--layers=2",
                                    "--width=16",          "--activation=gelu",
                                    "--batch=4",           absl::StrCat("--steps=", kSteps),
                                    "--stage=3",           "--shard_group_size=2",
                                    "--lr=0.01",           "--seed=3",
                                    "--checkpoint_at_end", "--collective_timeout=30s"};
  flags.insert(flags.end(), extra.begin(), extra.end());
  return flags;
}

TEST(ReplicaCheckTest, ACorruptedReplicaIsFoundAtTheNextCheckNamingItsRank) {
  LocalCluster cluster(testing::MakeTempDir("replica_check"));
  ASSERT_TRUE(cluster.ok());
  cluster.StartWorkers("corrupt", kWorld,
                       Flags({"--replica_check_every=5", "--testing_corrupt=1:12"}));
  const std::vector<int> codes = cluster.WaitWorkers(absl::Seconds(120));
  for (int rank = 0; rank < kWorld; ++rank) {
    const std::string log = cluster.WorkerLog(rank);
    EXPECT_EQ(codes[rank], 1) << log;
    EXPECT_NE(log.find("after step 15/20: the replicas of shard member 1 differ (rank 1 (host "),
              std::string::npos)
        << log;
    EXPECT_NE(log.find("rank 3 (host "), std::string::npos) << log;
  }
  const std::string log0 = cluster.WorkerLog(0);
  EXPECT_NE(log0.find("step 15/20  loss"), std::string::npos) << log0;
  EXPECT_EQ(log0.find("step 16/20  loss"), std::string::npos) << log0;
}

testing::Params FinalParams(const LocalCluster& cluster, const std::string& job, int steps) {
  const absl::StatusOr<ModelSpec> spec = MlpSpec(2, 16, "gelu");
  if (!spec.ok()) return {};
  return testing::LoadCheckpointParams(cluster.checkpoint_root(), job, steps, *spec);
}

TEST(ReplicaCheckTest, ACorruptedReplicaIsRewoundNamedAndTheRunEqualsAnUncorruptedOne) {
  LocalCluster cluster(testing::MakeTempDir("replica_rewind"));
  ASSERT_TRUE(cluster.ok());
  const std::vector<std::string> checked = {"--replica_check_every=5", "--snapshot_every=5"};
  std::vector<std::string> corrupt = checked;
  corrupt.push_back("--testing_corrupt=1:12");
  ASSERT_TRUE(cluster.Run("corrupt", kWorld, Flags(corrupt)));
  const std::string log = cluster.WorkerLog(0);
  EXPECT_NE(log.find("after step 15/20: the replicas of shard member 1 differ (rank 1 (host "),
            std::string::npos)
      << log;
  EXPECT_NE(log.find("; rewound every rank to the snapshot of step "), std::string::npos) << log;
  EXPECT_NE(log.find("corrupted shard: rank 1 (host 127.0.0.1): its master shard after step 15 "
                     "was up to "),
            std::string::npos)
      << log;
  EXPECT_EQ(log.find("corrupted shard: rank 3"), std::string::npos) << log;
  const nlohmann::json report = cluster.Report("corrupt", 0);
  ASSERT_EQ(report["rewinds"].size(), 1u) << report.dump();
  EXPECT_EQ(report["rewinds"][0]["bad_step"], 16) << report.dump();
  EXPECT_TRUE(report["rewinds"][0]["to_step"] == 10 || report["rewinds"][0]["to_step"] == 5)
      << report.dump();
  EXPECT_EQ(report["rewinds"][0]["corrupted_rank"], 1) << report.dump();

  ASSERT_TRUE(cluster.Run("uncorrupted", kWorld, Flags(checked)));
  const testing::Params rewound = FinalParams(cluster, "corrupt", kSteps);
  ASSERT_FALSE(rewound.empty());
  EXPECT_EQ(rewound, FinalParams(cluster, "uncorrupted", kSteps));
}

// Rank 1 corrupted after steps 12 and 17: both are rewound and named, the
// server shows the first (shardctl status, /metrics), and the second evicts
// rank 1's host, 127.0.0.1 here: every rank there (all four) stops.
TEST(ReplicaCheckTest, ASecondCorruptionOnARankEvictsItsHost) {
  const std::string dir = testing::MakeTempDir("replica_evict");
  LocalCluster cluster(dir,
                       {"--metrics_listen=127.0.0.1:0", "--metrics_port_file=" + dir + "/mport",
                        "--heartbeat_interval_ms=100"});
  ASSERT_TRUE(cluster.ok());
  std::vector<std::string> flags =
      Flags({"--replica_check_every=5", "--snapshot_every=5", "--testing_corrupt=1:12,1:17",
             "--steps=25", "--test_step_delay_ms=100"});
  cluster.StartWorkers("evict", kWorld, flags);
  const std::string shardctl =
      absl::StrCat(testing::RunfilePath("client/shardctl"), " --server=", cluster.address());
  std::string status, metrics;
  bool shown = false;
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  while (!shown && absl::Now() < deadline) {
    status = testing::RunCommand(shardctl + " status --job=evict").second;
    const std::string port(absl::StripAsciiWhitespace(testing::ReadFileOrEmpty(dir + "/mport")));
    metrics =
        testing::RunCommand(absl::StrCat("curl -s http://127.0.0.1:", port, "/metrics")).second;
    shown = status.find("evict corrupted shard: rank 1 (host 127.0.0.1) is the last of 1 named") !=
                std::string::npos &&
            status.find("evict rewinds: 1 (loss spikes: 0, replica mismatches: 1") !=
                std::string::npos &&
            metrics.find("zeroshard_job_replica_mismatches_total{job=\"evict\"} 1\n") !=
                std::string::npos &&
            metrics.find("zeroshard_job_rewinds_total{job=\"evict\"} 1\n") != std::string::npos &&
            metrics.find("zeroshard_job_corrupted_shards_total{job=\"evict\"} 1\n") !=
                std::string::npos;
    if (!shown) absl::SleepFor(absl::Milliseconds(100));
  }
  EXPECT_TRUE(shown) << "shardctl status:\n"
                     << status << "\n/metrics:\n"
                     << metrics << "\nrank 0:\n"
                     << cluster.WorkerLog(0);
  const std::vector<int> codes = cluster.WaitWorkers(absl::Seconds(120));
  for (int rank = 0; rank < kWorld; ++rank) {
    const std::string log = cluster.WorkerLog(rank);
    EXPECT_EQ(codes[rank], 1) << log;
    EXPECT_NE(log.find("evicting host 127.0.0.1: rank 1's shard was corrupted 2 times"),
              std::string::npos)
        << log;
  }
  const std::string log0 = cluster.WorkerLog(0);
  EXPECT_NE(log0.find("after step 20/25: the replicas of shard member 1 differ"), std::string::npos)
      << log0;
  // The server fenced the machine (all four ranks' here): status and
  // /metrics say so, with the command that lifts it.
  status = testing::RunCommand(shardctl + " status --job=evict").second;
  EXPECT_NE(status.find("evict FENCED machine '"), std::string::npos) << status;
  EXPECT_NE(status.find("shardctl unfence --job=evict --host="), std::string::npos) << status;
  const std::string port(absl::StripAsciiWhitespace(testing::ReadFileOrEmpty(dir + "/mport")));
  metrics = testing::RunCommand(absl::StrCat("curl -s http://127.0.0.1:", port, "/metrics")).second;
  EXPECT_NE(metrics.find("zeroshard_job_fenced_hosts{job=\"evict\"} 1\n"), std::string::npos)
      << metrics;
  EXPECT_NE(log0.find("the server fenced machine '"), std::string::npos) << log0;
}

TEST(ReplicaCheckTest, TheCheckChangesNothing) {
  LocalCluster cluster(testing::MakeTempDir("replica_check"));
  ASSERT_TRUE(cluster.ok());
  ASSERT_TRUE(cluster.Run("checked", kWorld, Flags({"--replica_check_every=1"})));
  ASSERT_TRUE(cluster.Run("plain", kWorld, Flags({})));
  const absl::StatusOr<ModelSpec> spec = MlpSpec(2, 16, "gelu");
  ASSERT_TRUE(spec.ok());
  const testing::Params checked =
      testing::LoadCheckpointParams(cluster.checkpoint_root(), "checked", kSteps, *spec);
  ASSERT_FALSE(checked.empty());
  EXPECT_EQ(checked,
            testing::LoadCheckpointParams(cluster.checkpoint_root(), "plain", kSteps, *spec));
}

}  // namespace
}  // namespace zeroshard
