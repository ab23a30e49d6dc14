// The replicated control plane's benchmark: a three-member etcd cluster
// (Debian's etcd-server) and three shard servers on loopback.
//
//   bazel run //tests/bench:failover_bench -- [--kills=20] [--json_out=FILE]
//
// Measures:
//  - failover: kill -9 of the leading server until another one listens
//    (serving) and until a client given every server's address is answered,
//    over --kills kills (the killed server is started again each time);
//  - quorum return: two etcd members of three stopped (SIGSTOP) until no
//    server leads, then continued (SIGCONT): ms from the SIGCONT until a
//    server listens and until a client is answered, over --quorum_losses;
//  - Join latency (a one-worker job formed and saved) and CommitShard latency
//    (a one-rank step recorded and its manifest written) with the state in
//    etcd vs SQLite (a lone server with --state_dir);
//  - etcd's write rate while a job's members heartbeat (simulated members, as
//    control_plane_bench's, every --beat_interval, at 256 and --members
//    members): it must be 0 and not grow with members, heartbeats never write.
#include <signal.h>

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
#include "absl/synchronization/blocking_counter.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "common/model_zoo.h"
#include "common/plan/plan_codec.h"
#include "common/server_list.h"
#include "common/table.h"
#include "nlohmann/json.hpp"
#include "tests/testing/bench_json.h"
#include "tests/testing/bench_machine.h"
#include "tests/testing/etcd_cluster.h"
#include "tests/testing/process.h"
#include "tests/testing/shard_files.h"
#include "tests/testing/simulated_members.h"

ABSL_FLAG(int, kills, 20, "Leader kills for the failover figures");
ABSL_FLAG(int, quorum_losses, 5,
          "etcd quorum losses (two members of three stopped, then continued) for the "
          "quorum-return figures");
ABSL_FLAG(int, joins, 50, "Joins timed per backend");
ABSL_FLAG(int, commits, 50, "Checkpoint commits timed per backend");
ABSL_FLAG(int, members, 4096,
          "Members of the larger job heartbeating during the write-rate window");
ABSL_FLAG(double, heartbeat_seconds, 5.0, "Length of the write-rate window");
ABSL_FLAG(absl::Duration, beat_interval, absl::Seconds(1),
          "Each simulated member's heartbeat interval (the workers' default; 0: back to back)");
ABSL_FLAG(std::string, json_out, "", "Write the results here as JSON");

namespace zeroshard {
namespace {

using testing::WaitFor;

struct Summary {
  double median_ms = 0;
  double max_ms = 0;
  double p90_ms = 0;
};

Summary Summarize(std::vector<double> ms) {
  Summary s;
  if (ms.empty()) return s;
  std::sort(ms.begin(), ms.end());
  s.median_ms = ms[ms.size() / 2];
  s.p90_ms = ms[std::min(ms.size() - 1, ms.size() * 9 / 10)];
  s.max_ms = ms.back();
  return s;
}

std::unique_ptr<Client> Connect(const std::string& servers) {
  ClientOptions options;
  options.server = servers;
  options.rpc_timeout = absl::Seconds(2);
  auto client = Client::Connect(options);
  if (!client.ok()) {
    std::fprintf(stderr, "%s\n", client.status().ToString().c_str());
    std::exit(1);
  }
  return *std::move(client);
}

// Kill -9 the leader `kills` times: ms until another server listens, and
// until a client of all servers is answered.
std::pair<std::vector<double>, std::vector<double>> MeasureFailovers(
    testing::ReplicatedServers& servers, int kills) {
  std::vector<double> serving, answered;
  std::unique_ptr<Client> client = Connect(servers.addresses());
  for (int k = 0; k < kills; ++k) {
    const int leader = servers.WaitLeader(absl::Seconds(30));
    if (leader < 0 || !WaitFor([&] { return client->GetStatus("").ok(); }, absl::Seconds(30))) {
      std::fprintf(stderr, "no leader before kill %d\n", k);
      std::exit(1);
    }
    servers.server(leader)->Signal(SIGKILL);
    const absl::Time killed = absl::Now();
    const int next = servers.WaitLeader(absl::Seconds(30), leader);
    const absl::Time listening = absl::Now();
    if (next < 0 || !WaitFor([&] { return client->GetStatus("").ok(); }, absl::Seconds(30))) {
      std::fprintf(stderr, "no new leader after kill %d\n", k);
      std::exit(1);
    }
    serving.push_back(absl::ToDoubleMilliseconds(listening - killed));
    answered.push_back(absl::ToDoubleMilliseconds(absl::Now() - killed));
    std::printf("  kill %2d: server %d -> %d, serving after %.0f ms, answered after %.0f ms\n",
                k + 1, leader, next, serving.back(), answered.back());
    std::fflush(stdout);
    servers.server(leader)->Wait(absl::Seconds(10));
    servers.Restart(leader);
  }
  return {serving, answered};
}

// Stops two etcd members of three `losses` times until no server leads, then
// continues them: ms from the continue until a server listens, and until a
// client of all servers is answered (etcd elects a leader of its own, then a
// server wins the campaign and loads the state).
std::pair<std::vector<double>, std::vector<double>> MeasureQuorumReturns(
    testing::EtcdCluster& etcd, testing::ReplicatedServers& servers, int losses) {
  std::vector<double> serving, answered;
  std::unique_ptr<Client> client = Connect(servers.addresses());
  for (int k = 0; k < losses; ++k) {
    if (servers.WaitLeader(absl::Seconds(30)) < 0 ||
        !WaitFor([&] { return client->GetStatus("").ok(); }, absl::Seconds(30))) {
      std::fprintf(stderr, "no leader before quorum loss %d\n", k);
      std::exit(1);
    }
    // A different pair each time, so the member that stays up varies.
    const int up = k % 3;
    for (int m = 0; m < 3; ++m) {
      if (m != up) etcd.member(m)->Signal(SIGSTOP);
    }
    const absl::Time stopped = absl::Now();
    // The leader's lease (2 s) runs out and it stops listening.
    const bool stepped_down = WaitFor([&] { return servers.Leader() < 0; }, absl::Seconds(30));
    const double down_ms = absl::ToDoubleMilliseconds(absl::Now() - stopped);
    for (int m = 0; m < 3; ++m) {
      if (m != up) etcd.member(m)->Signal(SIGCONT);
    }
    const absl::Time back = absl::Now();
    if (!stepped_down) {
      std::fprintf(stderr, "a server still led 30 s into quorum loss %d\n", k);
      std::exit(1);
    }
    const int leader = servers.WaitLeader(absl::Seconds(60));
    const absl::Time listening = absl::Now();
    if (leader < 0 || !WaitFor([&] { return client->GetStatus("").ok(); }, absl::Seconds(60))) {
      std::fprintf(stderr, "no leader 60 s after the quorum returned (loss %d)\n", k);
      std::exit(1);
    }
    serving.push_back(absl::ToDoubleMilliseconds(listening - back));
    answered.push_back(absl::ToDoubleMilliseconds(absl::Now() - back));
    std::printf(
        "  quorum loss %2d: no leader %.0f ms after the stop; quorum back -> server %d serving "
        "after %.0f ms, answered after %.0f ms\n",
        k + 1, down_ms, leader, serving.back(), answered.back());
    std::fflush(stdout);
  }
  return {serving, answered};
}

// ms of each of `count` one-worker joins (a job formed and saved).
std::vector<double> MeasureJoins(const std::string& servers, const std::string& tag, int count) {
  std::unique_ptr<Client> probe = Connect(servers);
  WaitFor([&] { return probe->GetStatus("").ok(); }, absl::Seconds(30));
  std::vector<double> ms;
  for (int i = 0; i < count; ++i) {
    std::unique_ptr<Client> client = Connect(servers);
    const absl::Time start = absl::Now();
    auto joined = client->Join(absl::StrCat(tag, "-", i), 1, "w0", "127.0.0.1", absl::Seconds(10));
    if (!joined.ok()) {
      std::fprintf(stderr, "join: %s\n", joined.status().ToString().c_str());
      std::exit(1);
    }
    ms.push_back(absl::ToDoubleMilliseconds(absl::Now() - start));
    (void)client->Leave();
  }
  return ms;
}

// ms of each of `count` checkpoint commits of a one-rank job: the shard file
// is written first (not timed), the commit records it and writes the step's
// manifest.
std::vector<double> MeasureCommits(const std::string& servers, const std::string& root,
                                   const std::string& tag, int count) {
  std::unique_ptr<Client> client = Connect(servers);
  const std::string job = tag + "-commits";
  auto joined = client->Join(job, 1, "w0", "127.0.0.1", absl::Seconds(10));
  absl::StatusOr<ModelSpec> spec = MlpSpec(2, 16, "none");
  absl::StatusOr<ShardPlan> plan =
      joined.ok() ? client->PlanShards(*spec, PlanOptions(), 1) : joined.status();
  if (!plan.ok()) {
    std::fprintf(stderr, "commit setup: %s\n", plan.status().ToString().c_str());
    std::exit(1);
  }
  const v1::ShardPlan proto = ShardPlanToProto(*plan);
  std::vector<double> ms;
  for (int step = 1; step <= count; ++step) {
    absl::StatusOr<testing::ShardFile> file =
        testing::WriteShardFile(root, job, proto, step, 0, joined->generation);
    if (!file.ok()) {
      std::fprintf(stderr, "shard file: %s\n", file.status().ToString().c_str());
      std::exit(1);
    }
    const absl::Time start = absl::Now();
    auto committed = client->CommitShard(step, file->relative, file->size, file->checksums);
    if (!committed.ok()) {
      std::fprintf(stderr, "commit: %s\n", committed.status().ToString().c_str());
      std::exit(1);
    }
    ms.push_back(absl::ToDoubleMilliseconds(absl::Now() - start));
  }
  (void)client->Leave();
  return ms;
}

struct WriteRate {
  int members = 0;
  double heartbeats_per_second = 0;
  double etcd_writes_per_second = 0;
};

// etcd's writes per second (revisions) while the `members` members of one
// job heartbeat every --beat_interval over 16 shared channels, after the job
// formed. (Back to back, 4,096 members saturate a 2-core machine that also
// runs etcd and this process, and the leader's lease renewals starve.)
WriteRate WritesWhileHeartbeating(testing::EtcdCluster& etcd, const std::string& servers,
                                  int members, absl::Duration window) {
  absl::StatusOr<std::string> target = GrpcTargetForServers(servers);
  auto stubs = testing::MakeStubs(*target, 16);
  const std::string job = absl::StrCat("beats-", members);
  testing::Joined joined = testing::JoinAll(stubs, job, members);
  if (joined.failures > 0) std::exit(1);
  std::atomic<bool> stop{false};
  std::atomic<int64_t> replies{0};
  absl::BlockingCounter finished(members);
  std::vector<std::unique_ptr<testing::Beater>> beaters;
  for (int i = 0; i < members; ++i) {
    beaters.push_back(std::make_unique<testing::Beater>(
        stubs[i % stubs.size()].get(), testing::Credentials(job, joined.responses[i]), "full",
        &stop, &replies, &finished, absl::GetFlag(FLAGS_beat_interval)));
  }
  absl::SleepFor(absl::Seconds(2));  // every stream open; the formation's writes are done
  const int64_t before = etcd.Revision();
  const int64_t beats_before = replies.load();
  const absl::Time start = absl::Now();
  absl::SleepFor(window);  // the measurement window itself
  const int64_t after = etcd.Revision();
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  WriteRate rate;
  rate.members = members;
  rate.heartbeats_per_second = (replies.load() - beats_before) / seconds;
  rate.etcd_writes_per_second = (after - before) / seconds;
  stop = true;
  finished.Wait();
  return rate;
}

// Joins and commits against a lone server with its state in SQLite.
std::pair<std::vector<double>, std::vector<double>> MeasureSqlite(const std::string& dir, int joins,
                                                                  int commits) {
  std::string sqlite_port = dir + "/sqlite-port";
  testing::ChildProcess sqlite_server(
      testing::RunfilePath("shard_server/shard_server"),
      {"--listen=127.0.0.1:0", "--port_file=" + sqlite_port, "--state_dir=" + dir + "/sqlite",
       "--checkpoint_root=" + dir + "/sqlite-checkpoints"},
      dir + "/sqlite-server.log");
  std::string port;
  WaitFor(
      [&] {
        port = testing::ReadFileOrEmpty(sqlite_port);
        return !port.empty() && port.back() == '\n';
      },
      absl::Seconds(20));
  if (!port.empty()) port.pop_back();
  std::vector<double> sqlite_joins = MeasureJoins("127.0.0.1:" + port, "sqlite", joins);
  std::vector<double> sqlite_commits =
      MeasureCommits("127.0.0.1:" + port, dir + "/sqlite-checkpoints", "sqlite", commits);
  return {sqlite_joins, sqlite_commits};
}

int Run() {
  BenchMachine machine = DescribeBenchMachine("");
  std::printf("%s\n", machine.Line().c_str());
  const std::string dir = testing::MakeTempDir("failover-bench");
  testing::EtcdCluster etcd(dir + "/etcd");
  if (!etcd.ok()) return 1;
  testing::ReplicatedServers servers(dir + "/servers", etcd.endpoints(),
                                     {"--heartbeat_interval_ms=1000", "--heartbeat_timeout_ms=3000",
                                      "--checkpoint_root=" + dir + "/etcd-checkpoints"});
  std::printf("failover: %d kills of the leader (lease TTL 2 s)\n", absl::GetFlag(FLAGS_kills));
  auto [serving, answered] = MeasureFailovers(servers, absl::GetFlag(FLAGS_kills));
  std::printf("quorum return: %d losses of etcd's quorum\n", absl::GetFlag(FLAGS_quorum_losses));
  auto [quorum_serving, quorum_answered] =
      MeasureQuorumReturns(etcd, servers, absl::GetFlag(FLAGS_quorum_losses));

  const int joins = absl::GetFlag(FLAGS_joins);
  std::vector<double> etcd_joins = MeasureJoins(servers.addresses(), "etcd", joins);
  const int commits = absl::GetFlag(FLAGS_commits);
  std::vector<double> etcd_commits =
      MeasureCommits(servers.addresses(), dir + "/etcd-checkpoints", "etcd", commits);
  auto [sqlite_joins, sqlite_commits] = MeasureSqlite(dir, joins, commits);

  const absl::Duration window = absl::Seconds(absl::GetFlag(FLAGS_heartbeat_seconds));
  std::vector<WriteRate> rates;
  for (int members : {256, absl::GetFlag(FLAGS_members)}) {
    rates.push_back(WritesWhileHeartbeating(etcd, servers.addresses(), members, window));
  }

  Summary s = Summarize(serving), a = Summarize(answered);
  Summary qs = Summarize(quorum_serving), qa = Summarize(quorum_answered);
  Summary je = Summarize(etcd_joins), js = Summarize(sqlite_joins);
  Summary ce = Summarize(etcd_commits), cs = Summarize(sqlite_commits);
  Table table({"measure", "median ms", "p90 ms", "max ms", "n"});
  auto row = [&](const std::string& name, const Summary& x, size_t n) {
    table.AddRow({name, absl::StrFormat("%.0f", x.median_ms), absl::StrFormat("%.0f", x.p90_ms),
                  absl::StrFormat("%.0f", x.max_ms), absl::StrCat(n)});
  };
  row("failover: kill -9 -> new leader serving", s, serving.size());
  row("failover: kill -9 -> client answered", a, answered.size());
  row("quorum back -> a leader serving", qs, quorum_serving.size());
  row("quorum back -> client answered", qa, quorum_answered.size());
  row("join (1 worker), state in etcd", je, etcd_joins.size());
  row("join (1 worker), state in SQLite", js, sqlite_joins.size());
  row("commit (1 rank, step complete), state in etcd", ce, etcd_commits.size());
  row("commit (1 rank, step complete), state in SQLite", cs, sqlite_commits.size());
  std::printf("\n%s", table.ToString().c_str());
  Table writes({"members", "heartbeats/s", "etcd writes/s"});
  for (const WriteRate& r : rates) {
    writes.AddRow({absl::StrCat(r.members), absl::StrFormat("%.0f", r.heartbeats_per_second),
                   absl::StrFormat("%.2f", r.etcd_writes_per_second)});
  }
  std::printf("\netcd writes while every member heartbeats every %s for %.0f s:\n%s",
              absl::FormatDuration(absl::GetFlag(FLAGS_beat_interval)).c_str(),
              absl::ToDoubleSeconds(window), writes.ToString().c_str());

  nlohmann::json json;
  json["machine"] = machine.Json();
  auto summary = [](const Summary& x) {
    return nlohmann::json{{"median_ms", x.median_ms}, {"p90_ms", x.p90_ms}, {"max_ms", x.max_ms}};
  };
  json["failover_serving"] = summary(s);
  json["failover_answered"] = summary(a);
  json["kills"] = serving.size();
  json["quorum_return_serving"] = summary(qs);
  json["quorum_return_answered"] = summary(qa);
  json["quorum_losses"] = quorum_serving.size();
  json["join_etcd"] = summary(je);
  json["join_sqlite"] = summary(js);
  json["commit_etcd"] = summary(ce);
  json["commit_sqlite"] = summary(cs);
  json["heartbeat_window_s"] = absl::ToDoubleSeconds(window);
  for (const WriteRate& r : rates) {
    json["write_rate"].push_back({{"members", r.members},
                                  {"heartbeats_per_second", r.heartbeats_per_second},
                                  {"etcd_writes_per_second", r.etcd_writes_per_second}});
  }
  return WriteBenchJson(json, absl::GetFlag(FLAGS_json_out));
}

}  // namespace
}  // namespace zeroshard

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return zeroshard::Run();
}
