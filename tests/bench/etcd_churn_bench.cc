// What a long life does to the replicated control plane's etcd: many
// one-member jobs joining and leaving (256-character worker ids, 128-character
// job ids) and a 64-rank job's checkpoint commits, against a real etcd with a
// small backend quota. etcd's database must stay a function of the live
// state (the leader compacts its history), no write may be refused, and a
// join must not slow down as history accumulates.
//
//   bazel run -c opt //tests/bench:etcd_churn_bench -- [--cycles=10000] [--commits=1000]
//       [--quota_mib=256] [--json_out=FILE]
//
// Prints, per block of cycles: the join latency (median, p90) and etcd's
// database size (file and in use); at the end the alarms etcd raised.
#include <algorithm>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "common/model_zoo.h"
#include "common/plan/plan_codec.h"
#include "common/table.h"
#include "nlohmann/json.hpp"
#include "tests/testing/bench_json.h"
#include "tests/testing/bench_machine.h"
#include "tests/testing/etcd_cluster.h"
#include "tests/testing/process.h"
#include "tests/testing/shard_files.h"

ABSL_FLAG(int, cycles, 10000, "Join+leave cycles of one-member jobs");
ABSL_FLAG(int, commits, 1000, "Checkpoint commits of the 64-rank job (spread over the cycles)");
ABSL_FLAG(int, ranks, 64, "Ranks of the checkpointing job");
ABSL_FLAG(int, blocks, 10, "Blocks the cycles are reported in");
ABSL_FLAG(int, quota_mib, 256, "etcd's --quota-backend-bytes, in MiB");
ABSL_FLAG(int, etcd_members, 1, "etcd members");
ABSL_FLAG(
    std::string, job_ttl, "5s",
    "The server's --job_ttl: a finished job is forgotten after it (with the default, 24 h, "
    "10,000 cycles would hit --max_jobs); the live state is the jobs of the last few seconds");
ABSL_FLAG(std::string, json_out, "", "Write the results here as JSON");

namespace zeroshard {
namespace {

std::unique_ptr<Client> Connect(const std::string& servers) {
  ClientOptions options;
  options.server = servers;
  options.rpc_timeout = absl::Seconds(10);
  auto client = Client::Connect(options);
  if (!client.ok()) {
    std::fprintf(stderr, "%s\n", client.status().ToString().c_str());
    std::exit(1);
  }
  return *std::move(client);
}

// The bench's processes, in statics so that Die's std::exit kills them too
// (their destructors kill and reap).
std::unique_ptr<testing::EtcdCluster> etcd_owner;
std::unique_ptr<testing::ReplicatedServers> servers_owner;

[[noreturn]] void Die(const std::string& what, const absl::Status& status) {
  std::fprintf(stderr, "FAILED: %s: %s\n", what.c_str(), status.ToString().c_str());
  std::exit(1);
}

double Percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(q * v.size()))];
}

struct DbSize {
  int64_t file = 0;
  int64_t in_use = 0;
};

// etcd's own view: `etcdctl endpoint status` of the first member.
DbSize ReadDbSize(const testing::EtcdCluster& etcd) {
  auto [code, out] = etcd.Etcdctl("endpoint status -w json");
  DbSize size;
  if (code != 0) return size;
  nlohmann::json j = nlohmann::json::parse(out, nullptr, false);
  if (!j.is_array() || j.empty()) return size;
  const nlohmann::json& status = j[0]["Status"];
  size.file = status.value("dbSize", int64_t{0});
  size.in_use = status.value("dbSizeInUse", int64_t{0});
  return size;
}

// The checkpointing job: `ranks` members joined at once, each committing
// its shard of a small MLP per step.
class CheckpointingJob {
 public:
  CheckpointingJob(const std::string& servers, const std::string& root, int ranks) : root_(root) {
    std::vector<std::thread> joins;
    clients_.resize(ranks);
    for (int r = 0; r < ranks; ++r) clients_[r] = Connect(servers);
    std::vector<absl::Status> joined(ranks);
    for (int r = 0; r < ranks; ++r) {
      joins.emplace_back([&, r] {
        joined[r] = clients_[r]
                        ->Join("churn-checkpoints", ranks, absl::StrCat("w", r), "127.0.0.1",
                               absl::Seconds(60))
                        .status();
      });
    }
    for (std::thread& t : joins) t.join();
    for (int r = 0; r < ranks; ++r) {
      if (!joined[r].ok()) Die("join of the checkpointing job", joined[r]);
    }
    absl::StatusOr<ModelSpec> spec = MlpSpec(2, 16, "none");
    absl::StatusOr<ShardPlan> plan = clients_[0]->PlanShards(*spec, PlanOptions(), ranks);
    if (!plan.ok()) Die("plan", plan.status());
    plan_ = ShardPlanToProto(*plan);
  }

  // Commits the next `count` shards (rank after rank, step after step).
  void Commit(int count) {
    for (int i = 0; i < count; ++i) {
      Client& c = *clients_[next_ % static_cast<int>(clients_.size())];
      const int rank = c.info().rank;
      const int64_t step = 1 + next_ / static_cast<int>(clients_.size());
      absl::StatusOr<testing::ShardFile> file = testing::WriteShardFile(
          root_, "churn-checkpoints", plan_, step, rank, c.info().generation);
      if (!file.ok()) Die("shard file", file.status());
      auto committed = c.CommitShard(step, file->relative, file->size, file->checksums);
      if (!committed.ok())
        Die(absl::StrCat("commit of step ", step, " rank ", rank), committed.status());
      ++next_;
    }
  }
  int committed() const { return next_; }

 private:
  const std::string root_;
  std::vector<std::unique_ptr<Client>> clients_;
  v1::ShardPlan plan_;
  int next_ = 0;
};

int Main() {
  const int cycles = absl::GetFlag(FLAGS_cycles);
  const int blocks = std::max(1, absl::GetFlag(FLAGS_blocks));
  const int commits = absl::GetFlag(FLAGS_commits);
  const int64_t quota = int64_t{absl::GetFlag(FLAGS_quota_mib)} << 20;
  const std::string dir = testing::MakeTempDir("etcd-churn");
  static testing::RemovedAtExit dir_owner(dir);  // also after Die's std::exit
  etcd_owner = std::make_unique<testing::EtcdCluster>(
      dir + "/etcd", absl::GetFlag(FLAGS_etcd_members), testing::OnHosts{},
      std::vector<std::string>{absl::StrCat("--quota-backend-bytes=", quota)});
  testing::EtcdCluster& etcd = *etcd_owner;
  if (!etcd.ok()) return 1;
  const std::string root = dir + "/checkpoints";
  testing::RunCommand("mkdir -p " + root);
  // Members of the checkpointing job do not beat: a long timeout keeps them.
  servers_owner = std::make_unique<testing::ReplicatedServers>(
      dir + "/servers", etcd.endpoints(),
      std::vector<std::string>{"--checkpoint_root=" + root, "--heartbeat_timeout_ms=3600000",
                               "--job_ttl=" + absl::GetFlag(FLAGS_job_ttl),
                               absl::StrCat("--etcd_quota_bytes=", quota)},
      /*count=*/1);
  testing::ReplicatedServers& servers = *servers_owner;
  if (servers.WaitLeader(absl::Seconds(30)) < 0) {
    std::fprintf(stderr, "no leader:\n%s\n", servers.Log(0).c_str());
    return 1;
  }
  const BenchMachine machine = DescribeBenchMachine("none (no matrix products)");
  std::printf("%s\n", machine.Line().c_str());
  std::printf("etcd: %d member(s), quota %d MiB; %d cycles, %d commits of a %d-rank job\n\n",
              absl::GetFlag(FLAGS_etcd_members), absl::GetFlag(FLAGS_quota_mib), cycles, commits,
              absl::GetFlag(FLAGS_ranks));
  CheckpointingJob job(servers.addresses(), root, absl::GetFlag(FLAGS_ranks));
  const std::string worker_id(256, 'w');
  Table table({"cycles", "join median ms", "join p90 ms", "commits", "etcd db MiB", "in use MiB"});
  nlohmann::json rows = nlohmann::json::array();
  std::vector<std::vector<double>> joins_by_block;
  const absl::Time start = absl::Now();
  for (int b = 0; b < blocks; ++b) {
    std::vector<double> ms;
    const int first = b * cycles / blocks;
    const int last = (b + 1) * cycles / blocks;
    for (int i = first; i < last; ++i) {
      std::unique_ptr<Client> client = Connect(servers.addresses());
      std::string job_id = absl::StrCat("churn-", i, "-");
      job_id.resize(128, 'j');
      const absl::Time t0 = absl::Now();
      auto joined = client->Join(job_id, 1, worker_id, "127.0.0.1", absl::Seconds(30));
      if (!joined.ok()) Die(absl::StrCat("join ", i), joined.status());
      ms.push_back(absl::ToDoubleMilliseconds(absl::Now() - t0));
      if (absl::Status left = client->Leave(); !left.ok()) Die(absl::StrCat("leave ", i), left);
    }
    job.Commit((b + 1) * commits / blocks - job.committed());
    const DbSize db = ReadDbSize(etcd);
    table.AddRow({absl::StrCat(last), absl::StrFormat("%.1f", Percentile(ms, 0.5)),
                  absl::StrFormat("%.1f", Percentile(ms, 0.9)), absl::StrCat(job.committed()),
                  absl::StrFormat("%.1f", db.file / 1048576.0),
                  absl::StrFormat("%.1f", db.in_use / 1048576.0)});
    rows.push_back({{"cycles", last},
                    {"join_median_ms", Percentile(ms, 0.5)},
                    {"join_p90_ms", Percentile(ms, 0.9)},
                    {"commits", job.committed()},
                    {"db_bytes", db.file},
                    {"db_in_use_bytes", db.in_use}});
    joins_by_block.push_back(std::move(ms));
    std::printf("  %d cycles, %d commits, %.0f s\n", last, job.committed(),
                absl::ToDoubleSeconds(absl::Now() - start));
    std::fflush(stdout);
  }
  auto [alarm_code, alarms] = etcd.Etcdctl("alarm list");
  const DbSize end = ReadDbSize(etcd);
  const double first_median = Percentile(joins_by_block.front(), 0.5);
  const double last_median = Percentile(joins_by_block.back(), 0.5);
  std::printf("\n%s\n", table.ToString().c_str());
  std::printf("etcd alarms: %s\n", alarms.empty() ? "none" : alarms.c_str());
  std::printf(
      "db at the end: %.1f MiB (target <= 64); last block's median join / first's: "
      "%.2f (target <= 1.5)\n",
      end.file / 1048576.0, first_median > 0 ? last_median / first_median : 0);
  if (!absl::GetFlag(FLAGS_json_out).empty()) {
    nlohmann::json out = {
        {"machine", machine.Json()},
        {"cycles", cycles},
        {"commits", commits},
        {"quota_bytes", quota},
        {"blocks", rows},
        {"alarms", alarms},
        {"db_bytes_end", end.file},
        {"join_median_ratio_last_first", first_median > 0 ? last_median / first_median : 0}};
    if (WriteBenchJson(out, absl::GetFlag(FLAGS_json_out)) != 0) return 1;
  }
  const int code = alarms.empty() && end.file <= (int64_t{64} << 20) ? 0 : 1;
  servers_owner.reset();
  etcd_owner.reset();
  return code;
}

}  // namespace
}  // namespace zeroshard

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return zeroshard::Main();
}
