// The replicated control plane's benchmark: a three-member etcd cluster
// (Debian's etcd-server) and three shard servers on loopback.
//
//   bazel run //tests/bench:failover_bench -- [--kills=20] [--json_out=FILE]
//
// Measures:
//  - failover: kill -9 of the leading server until another one listens
//    (serving) and until a client given every server's address is answered,
//    over --kills kills (the killed server is started again each time);
//  - Join latency (a one-worker job formed and saved) with the state in etcd
//    vs SQLite (a lone server with --state_dir);
//  - etcd's write rate while a job's members only heartbeat (--members
//    clients in this process): it must be 0, heartbeats never write.
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
#include "absl/time/clock.h"
#include "client/client.h"
#include "common/table.h"
#include "nlohmann/json.hpp"
#include "tests/testing/bench_json.h"
#include "tests/testing/bench_machine.h"
#include "tests/testing/etcd_cluster.h"
#include "tests/testing/process.h"

ABSL_FLAG(int, kills, 20, "Leader kills for the failover figures");
ABSL_FLAG(int, joins, 50, "Joins timed per backend");
ABSL_FLAG(int, members, 256, "Members heartbeating during the etcd write-rate window");
ABSL_FLAG(double, heartbeat_seconds, 5.0, "Length of the write-rate window");
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

// etcd revisions (writes) while `members` members of one job heartbeat.
int64_t WritesWhileHeartbeating(testing::EtcdCluster& etcd, const std::string& servers, int members,
                                absl::Duration window) {
  std::vector<std::unique_ptr<Client>> clients;
  for (int i = 0; i < members; ++i) clients.push_back(Connect(servers));
  std::vector<std::thread> joins;
  for (int i = 0; i < members; ++i) {
    joins.emplace_back([&, i] {
      auto joined =
          clients[i]->Join("beats", members, absl::StrCat("w", i), "127.0.0.1", absl::Seconds(60));
      if (!joined.ok()) std::fprintf(stderr, "join: %s\n", joined.status().ToString().c_str());
    });
  }
  for (std::thread& t : joins) t.join();
  for (auto& c : clients) c->StartHeartbeats([](auto) {});
  absl::SleepFor(absl::Seconds(2));  // the formation's writes are done
  const int64_t before = etcd.Revision();
  absl::SleepFor(window);  // the measurement window itself
  const int64_t after = etcd.Revision();
  for (auto& c : clients) c->StopHeartbeats();
  return after - before;
}

int Run() {
  BenchMachine machine = DescribeBenchMachine("");
  std::printf("%s\n", machine.Line().c_str());
  const std::string dir = testing::MakeTempDir("failover-bench");
  testing::EtcdCluster etcd(dir + "/etcd");
  if (!etcd.ok()) return 1;
  testing::ReplicatedServers servers(
      dir + "/servers", etcd.endpoints(),
      {"--heartbeat_interval_ms=1000", "--heartbeat_timeout_ms=3000"});
  std::printf("failover: %d kills of the leader (lease TTL 2 s)\n", absl::GetFlag(FLAGS_kills));
  auto [serving, answered] = MeasureFailovers(servers, absl::GetFlag(FLAGS_kills));

  const int joins = absl::GetFlag(FLAGS_joins);
  std::vector<double> etcd_joins = MeasureJoins(servers.addresses(), "etcd", joins);
  std::string sqlite_port = dir + "/sqlite-port";
  testing::ChildProcess sqlite_server(
      testing::RunfilePath("shard_server/shard_server"),
      {"--listen=127.0.0.1:0", "--port_file=" + sqlite_port, "--state_dir=" + dir + "/sqlite"},
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

  const int members = absl::GetFlag(FLAGS_members);
  const absl::Duration window = absl::Seconds(absl::GetFlag(FLAGS_heartbeat_seconds));
  const int64_t writes = WritesWhileHeartbeating(etcd, servers.addresses(), members, window);

  Summary s = Summarize(serving), a = Summarize(answered);
  Summary je = Summarize(etcd_joins), js = Summarize(sqlite_joins);
  Table table({"measure", "median ms", "p90 ms", "max ms", "n"});
  auto row = [&](const std::string& name, const Summary& x, size_t n) {
    table.AddRow({name, absl::StrFormat("%.0f", x.median_ms), absl::StrFormat("%.0f", x.p90_ms),
                  absl::StrFormat("%.0f", x.max_ms), absl::StrCat(n)});
  };
  row("failover: kill -9 -> new leader serving", s, serving.size());
  row("failover: kill -9 -> client answered", a, answered.size());
  row("join (1 worker), state in etcd", je, etcd_joins.size());
  row("join (1 worker), state in SQLite", js, sqlite_joins.size());
  std::printf("\n%s", table.ToString().c_str());
  std::printf("etcd writes while %d members heartbeat for %.0f s: %lld\n", members,
              absl::ToDoubleSeconds(window), static_cast<long long>(writes));

  nlohmann::json json;
  json["machine"] = machine.Json();
  auto summary = [](const Summary& x) {
    return nlohmann::json{{"median_ms", x.median_ms}, {"p90_ms", x.p90_ms}, {"max_ms", x.max_ms}};
  };
  json["failover_serving"] = summary(s);
  json["failover_answered"] = summary(a);
  json["kills"] = serving.size();
  json["join_etcd"] = summary(je);
  json["join_sqlite"] = summary(js);
  json["heartbeat_members"] = members;
  json["heartbeat_window_s"] = absl::ToDoubleSeconds(window);
  json["etcd_writes_while_heartbeating"] = writes;
  return WriteBenchJson(json, absl::GetFlag(FLAGS_json_out));
}

}  // namespace
}  // namespace zeroshard

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return zeroshard::Run();
}
