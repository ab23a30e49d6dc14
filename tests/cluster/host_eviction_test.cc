// A second silent corruption on one rank evicts its machine (#43,
// docs/numerics.md). W = 4 as 2 emulated hosts x 2 ranks (w0, w1 on host 1;
// w2, w3 on host 2) in HSDP groups of 2: ranks 0 and 2 hold one shard member,
// 1 and 3 the other, so every replica pair spans the hosts. Rank 1's master
// shard is corrupted after steps 12 and 17 (--testing_corrupt): the replica
// check (every 5 steps) finds each, rewinds and names rank 1; the second
// naming makes the ranks ask the server to evict host 1. The server fences
// host 1's node (hostname + boot id) from the job and declares w0 and w1 dead
// at once (a new generation); w0 started again on host 1 is refused, naming
// the machine, why, and the shardctl command that lifts the fence; w0 and w1
// started on host 0 replace them, restore from the replicas on host 2, and
// the job finishes bitwise equal to an uncorrupted run. The fence shows in
// shardctl status (text and --json) and /metrics, survives a restart of the
// server, and `shardctl unfence` lifts it.
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "tests/cluster/across_hosts.h"
#include "tests/testing/process.h"

namespace zeroshard::testing {
namespace {

using HostEvictionTest = AcrossHostsTest;

constexpr int kSteps = 25;
constexpr char kJob[] = "evict";

class Eviction {
 public:
  Eviction(EmulatedHosts* hosts, LocalCluster* cluster, std::string metrics_port_file)
      : hosts_(hosts), cluster_(cluster), port_file_(std::move(metrics_port_file)) {}

  // shardctl `args` run on the server's host (the namespaces' network):
  // (exit code, output).
  std::pair<int, std::string> Shardctl(const std::string& args) const {
    return hosts_->Run(0, absl::StrCat(RunfilePath("client/shardctl"),
                                       " --server=", cluster_->address(), " ", args, " 2>&1"));
  }
  std::string Metrics() const {
    const std::string port(absl::StripAsciiWhitespace(ReadFileOrEmpty(port_file_)));
    return hosts_
        ->Run(0, absl::StrCat("curl -s http://", hosts_->address(0), ":", port, "/metrics"))
        .second;
  }
  // Waits until status, its JSON and /metrics all show host 1 fenced.
  bool WaitShown(std::string* seen) const {
    const std::string line = absl::StrCat(kJob, " FENCED machine 'host1 ");
    return WaitFor(
        [&] {
          const std::string status = Shardctl(absl::StrCat("status --job=", kJob)).second;
          const std::string json = Shardctl(absl::StrCat("status --job=", kJob, " --json")).second;
          const std::string metrics = Metrics();
          *seen = absl::StrCat("status:\n", status, "\njson:\n", json, "\nmetrics:\n", metrics);
          return status.find(line) != std::string::npos &&
                 status.find("silent corruption on rank 1 at step ") != std::string::npos &&
                 status.find("shardctl unfence --job=evict --host=host1") != std::string::npos &&
                 json.find("\"fenced_hosts\"") != std::string::npos &&
                 json.find("\"node\": \"host1 ") != std::string::npos &&
                 metrics.find("zeroshard_job_fenced_hosts{job=\"evict\"} 1\n") != std::string::npos;
        },
        absl::Seconds(30));
  }

 private:
  EmulatedHosts* hosts_;
  LocalCluster* cluster_;
  std::string port_file_;
};

TEST_F(HostEvictionTest, ASecondCorruptionOnARankFencesItsMachineAndTheJobFinishesWithout) {
  const std::string mdir = MakeTempDir("evict-metrics");
  // Heartbeats as the fixture's; the metrics on the server's host.
  ASSERT_TRUE(
      StartCluster({"--metrics_listen=198.18.0.1:0", "--metrics_port_file=" + mdir + "/mport"}));
  Eviction eviction(hosts_.get(), cluster_.get(), mdir + "/mport");
  const std::vector<std::string> common = {
      absl::StrCat("--steps=", kSteps), "--shard_group_size=2",
      "--replica_check_every=5",        "--snapshot_every=5",
      "--collective_timeout=8s",        "--test_step_delay_ms=100"};
  ASSERT_TRUE(cluster_->Run("reference", 4, Flags(common)));
  const Params reference = Final("reference", kSteps);
  ASSERT_FALSE(reference.empty());

  std::vector<std::string> flags = common;
  flags.push_back("--testing_corrupt=1:12,1:17");
  cluster_->StartWorkers(kJob, 4, Flags(flags));
  // Host 1's ranks stop once the server fenced their machine.
  for (int r : {0, 1}) {
    const int code = cluster_->worker(r)->Wait(absl::Seconds(90));
    const std::string log = cluster_->WorkerLog(r);
    EXPECT_EQ(code, 1) << log;
    EXPECT_NE(log.find("rank 1's shard was corrupted 2 times"), std::string::npos) << log;
    EXPECT_NE(log.find("the server fenced machine 'host1 "), std::string::npos) << log;
  }
  std::string seen;
  EXPECT_TRUE(eviction.WaitShown(&seen)) << seen;

  // w0 again on host 1: refused, saying which machine, why and what to do.
  cluster_->RestartWorker(0, {"--testing_corrupt="});
  EXPECT_NE(cluster_->worker(0)->Wait(absl::Seconds(60)), 0);
  const std::string refused = cluster_->WorkerLog(0);
  EXPECT_NE(refused.find("runs on machine 'host1 "), std::string::npos) << refused;
  EXPECT_NE(refused.find("which is fenced from job 'evict'"), std::string::npos) << refused;
  EXPECT_NE(refused.find("silent corruption on rank 1 at step "), std::string::npos) << refused;
  EXPECT_NE(refused.find("shardctl unfence --job=evict --host=host1"), std::string::npos)
      << refused;

  // Replacements on host 0: the job finishes, restored from host 2's replicas.
  for (int r : {0, 1}) {
    cluster_->MoveWorker(r, 0);
    cluster_->RestartWorker(r, {"--testing_corrupt="});
  }
  ASSERT_TRUE(AllExitZero(absl::Seconds(120)));
  ExpectEqual(Final(kJob, kSteps), reference, "host 1 evicted, replaced on host 0");
  const std::string server_log = cluster_->server()->Log();
  EXPECT_NE(server_log.find("event=host_evicted"), std::string::npos) << server_log;

  // The fence is state: a restarted server still refuses host 1.
  cluster_->RestartServer();
  EXPECT_TRUE(eviction.WaitShown(&seen)) << seen;
  const auto [wrong, wrong_out] = eviction.Shardctl("unfence --job=evict --host=host9");
  EXPECT_EQ(wrong, 1) << wrong_out;
  const auto [code, out] = eviction.Shardctl("unfence --job=evict --host=host1");
  EXPECT_EQ(code, 0) << out;
  EXPECT_NE(out.find("lifted the fence on 'host1 "), std::string::npos) << out;
  const std::string after = eviction.Shardctl("status --job=evict").second;
  EXPECT_EQ(after.find("FENCED"), std::string::npos) << after;
}

}  // namespace
}  // namespace zeroshard::testing
