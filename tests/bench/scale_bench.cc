// A simulated job of 100,000 ranks on one machine: 12,500 simulated node
// agents of 8 ranks each, in a few processes, against a real shard_server.
// A simulated agent is what shard_agent is to the server: one HostHeartbeat
// stream carrying its 8 ranks' beats (each with a training rank's full
// telemetry) every second, and its ranks' joins in one HostJoin call. No
// worker processes.
//
//   bazel run -c opt //tests/bench:scale_bench -- [--hosts=12500] [--json_out=FILE]
//       [--connections_per_process=C]
//
// With C > 0 a process's agents share C TCP connections (HTTP/2 streams), so
// the server holds processes x C connections instead of one per agent: on a
// small machine 12,500 connections take minutes to come up (docs/scale.md).
//
// Measures: the join barrier (every rank's join answered, from the moment
// the agents send them); the server's CPU and RSS while every rank beats
// once a second; GET /metrics (size, time); a rank that falls silent and a
// host whose agent falls silent: the time the server took to declare them
// dead after their last beat, and the generation change end to end (every
// survivor told, every rank re-joined and the next generation formed).
//
// This file is the parent; the simulating processes' half is
// scale_bench_child.cc (what the two share: scale_bench.h).
#include "tests/bench/scale_bench.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/server_list.h"
#include "common/table.h"
#include "grpcpp/grpcpp.h"
#include "nlohmann/json.hpp"
#include "proto/zeroshard.grpc.pb.h"
#include "tests/testing/bench_json.h"
#include "tests/testing/bench_machine.h"
#include "tests/testing/control_plane_sim.h"
#include "tests/testing/etcd_cluster.h"
#include "tests/testing/process.h"

ABSL_FLAG(int, hosts, 12500, "Simulated hosts (node agents)");
ABSL_FLAG(int, ranks_per_host, 8, "Ranks per host");
ABSL_FLAG(int, processes, 16, "Processes the simulated agents are spread over");
ABSL_FLAG(int, heartbeat_timeout_ms, 3000, "The server's --heartbeat_timeout_ms");
ABSL_FLAG(int, heartbeat_interval_ms, 1000,
          "The server's --heartbeat_interval_ms, which the simulated agents beat at");
ABSL_FLAG(double, measure_seconds, 10, "Length of the CPU measurement while every rank beats");
ABSL_FLAG(int, connections_per_process, 0,
          "TCP connections each simulating process opens to the server, its agents' streams "
          "spread over them; 0: one per agent, as real agents have");
ABSL_FLAG(std::string, telemetry, "full", "What each beat carries: full, step or none");
ABSL_FLAG(bool, same_member, true,
          "After a rank's first beat on the stream, send RankBeat.same_member instead of its "
          "credentials, as shard_agent does (false: credentials in every beat)");
ABSL_FLAG(std::string, server_binary, "", "shard_server binary (default: from runfiles)");
ABSL_FLAG(std::string, json_out, "", "Write the results here as JSON");
ABSL_FLAG(std::vector<std::string>, server_flags, {},
          "More flags for the server, comma-separated (e.g. --heartbeat_queues=2)");
// 16 processes of ~780 agents: Debian's libgrpc is built without NDEBUG, and
// its completion queues then scan every outstanding call on every event.
// A child process's part (set by the parent).
ABSL_FLAG(int, etcd_members, 0,
          "0: one server with its state in memory or as --server_flags say. N: an N-member etcd "
          "cluster on loopback and --servers shard servers on it; after the faults the leader is "
          "killed with -9 and every host's next beat must be answered by the next leader");
ABSL_FLAG(int, servers, 3, "Shard servers on etcd (with --etcd_members)");
ABSL_FLAG(int, child, -1, "internal: this process's index among the simulating processes");
ABSL_FLAG(std::string, dir, "", "internal: the run's directory");
ABSL_FLAG(std::string, server, "", "internal: the server's address");
ABSL_FLAG(int, first_host, 0, "internal: this process's first host");
ABSL_FLAG(int, host_count, 0, "internal: this process's hosts");
ABSL_FLAG(std::string, server_cpus, "",
          "CPUs the server runs on, as taskset lists them (\"0\", \"0-3,8\"); empty: any. With "
          "--simulator_cpus elsewhere, the server's CPU is measured without the simulators on "
          "its cores (docs/scale.md)");
ABSL_FLAG(std::string, simulator_cpus, "", "CPUs the simulating processes run on; empty: any");
ABSL_FLAG(
    int, simulator_nice, 0,
    "Niceness of the simulating processes: on a machine too small for 100,000 simulated ranks "
    "beside etcd and three servers, a positive value keeps the control plane's lease "
    "renewals from starving behind them (in a cluster they run on other machines)");

namespace zeroshard {
namespace scale_bench {
namespace {

// --------------------------------------------------------------- parent --

struct Totals {
  Round round;
  int64_t answers = 0;
  int64_t errors = 0;
  int64_t join_retries = 0;
  int64_t max_late_us = 0;  // the latest beat the simulators sent, after it was due
  int64_t late_over_1s = 0;
  int64_t first_too_late_us = 0;        // a beat timeout - interval late (0: none)
  int64_t max_probe_late_us = 0;        // the simulators' callbacks at worst (Child::SetProbe)
  int64_t first_probe_too_late_us = 0;  // a callback timeout - interval late (0: none)
  std::string first_error;
};

// The children's reports of `round`, added up.
Totals Collect(const std::string& dir, int processes, int round) {
  Totals t;
  for (int i = 0; i < processes; ++i) {
    std::string text = testing::ReadFileOrEmpty(absl::StrCat(dir, "/status-", i));
    if (text.empty()) continue;
    nlohmann::json s = nlohmann::json::parse(text, nullptr, false);
    if (s.is_discarded()) continue;
    t.answers += s.value("answers", int64_t{0});
    t.errors += s.value("errors", int64_t{0});
    t.join_retries += s.value("join_retries", int64_t{0});
    t.max_late_us = std::max(t.max_late_us, s.value("max_late_us", int64_t{0}));
    t.late_over_1s += s.value("late_over_1s", int64_t{0});
    if (int64_t first = s.value("first_too_late_us", int64_t{0});
        first > 0 && (t.first_too_late_us == 0 || first < t.first_too_late_us)) {
      t.first_too_late_us = first;
    }
    t.max_probe_late_us = std::max(t.max_probe_late_us, s.value("max_probe_late_us", int64_t{0}));
    if (int64_t first = s.value("first_probe_too_late_us", int64_t{0});
        first > 0 && (t.first_probe_too_late_us == 0 || first < t.first_probe_too_late_us)) {
      t.first_probe_too_late_us = first;
    }
    if (t.first_error.empty()) t.first_error = s.value("first_error", "");
    if (!s.contains("rounds") || static_cast<int>(s["rounds"].size()) <= round) continue;
    const nlohmann::json& r = s["rounds"][round];
    t.round.joined += r["joined"].get<int>();
    t.round.joined_last_us = std::max(t.round.joined_last_us, r["joined_last_us"].get<int64_t>());
    t.round.aborted += r["aborted"].get<int>();
    t.round.aborted_last_us =
        std::max(t.round.aborted_last_us, r["aborted_last_us"].get<int64_t>());
    t.round.join_errors += r["join_errors"].get<int>();
    if (t.round.first_join_error.empty()) t.round.first_join_error = r["first_join_error"];
  }
  return t;
}

// The latest round if every host joined it and none has been told of a
// generation change since (a steady job); -1 otherwise.
int SteadyRound(const std::string& dir, int processes, int hosts) {
  int latest = -1;
  for (int i = 0; i < processes; ++i) {
    nlohmann::json s = nlohmann::json::parse(
        testing::ReadFileOrEmpty(absl::StrCat(dir, "/status-", i)), nullptr, false);
    if (s.is_discarded() || !s.contains("rounds")) return -1;
    latest = std::max(latest, static_cast<int>(s["rounds"].size()) - 1);
  }
  if (latest < 0) return -1;
  const Totals t = Collect(dir, processes, latest);
  return t.round.joined == hosts && t.round.aborted == 0 ? latest : -1;
}

// Whether every process's answers came back within `bound` of their beats
// in its last whole second: the server is not behind (nor the simulators).
bool AnswersPrompt(const std::string& dir, int processes, absl::Duration bound) {
  for (int i = 0; i < processes; ++i) {
    nlohmann::json s = nlohmann::json::parse(
        testing::ReadFileOrEmpty(absl::StrCat(dir, "/status-", i)), nullptr, false);
    if (s.is_discarded()) return false;
    const int64_t rtt = s.value("round_trip_last_second_us", int64_t{-1});
    if (rtt < 0 || rtt > absl::ToInt64Microseconds(bound)) return false;
  }
  return true;
}

// The server's member_dead events, by worker id: when, and how long the
// member had been silent then.
struct Death {
  absl::Time at;
  double silent_s = 0;
};

// Reads the server's log as it grows, from where it stopped last time: at
// 100K ranks the log holds a line per join (tens of MB), and reading it
// whole every 10 ms would take the CPU the server is measured on.
class DeathsInLog {
 public:
  explicit DeathsInLog(std::string path) : path_(std::move(path)) {}

  // The deaths logged so far (the latest per worker).
  const std::map<std::string, Death>& Update() {
    std::ifstream in(path_, std::ios::binary);
    in.seekg(offset_);
    std::string chunk((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    offset_ += static_cast<int64_t>(chunk.size());
    partial_ += chunk;
    size_t start = 0;
    for (size_t end; (end = partial_.find('\n', start)) != std::string::npos; start = end + 1) {
      ReadLine(absl::string_view(partial_).substr(start, end - start));
    }
    partial_.erase(0, start);
    return deaths_;
  }

 private:
  void ReadLine(absl::string_view line) {
    if (!absl::StrContains(line, " event=member_dead ")) return;
    Death d;
    std::string worker;
    for (absl::string_view field : absl::StrSplit(line, ' ')) {
      if (absl::ConsumePrefix(&field, "ts=")) {
        std::string error;
        absl::ParseTime("%Y-%m-%dT%H:%M:%E3SZ", field, absl::UTCTimeZone(), &d.at, &error);
      } else if (absl::ConsumePrefix(&field, "worker=")) {
        worker = std::string(field);
      } else if (absl::ConsumePrefix(&field, "silent_ms=")) {
        double ms = 0;
        absl::SimpleAtod(field, &ms);
        d.silent_s = ms / 1000;
      }
    }
    deaths_[worker] = d;
  }

  const std::string path_;
  int64_t offset_ = 0;   // bytes of the log read so far
  std::string partial_;  // a line not yet complete
  std::map<std::string, Death> deaths_;
};

// The sockets process `pid` holds open (its connections and listeners).
int SocketsOpen(pid_t pid) {
  int sockets = 0;
  std::error_code error;
  for (const auto& entry :
       std::filesystem::directory_iterator(absl::StrCat("/proc/", pid, "/fd"), error)) {
    std::error_code link_error;
    std::string target = std::filesystem::read_symlink(entry.path(), link_error).string();
    if (!link_error && absl::StartsWith(target, "socket:")) ++sockets;
  }
  return sockets;
}

void Command(const std::string& dir, int process, const std::string& command) {
  std::ofstream(absl::StrCat(dir, "/cmd-", process), std::ios::app) << command << "\n";
}

// A value of the server's /metrics at metrics port `mport` (-1: none).
double MetricsValue(const std::string& mport, const std::string& name) {
  auto [code, out] =
      testing::RunCommand(absl::StrCat("curl -s http://127.0.0.1:", mport, "/metrics"));
  for (absl::string_view line : absl::StrSplit(out, '\n')) {
    if (!absl::ConsumePrefix(&line, name + " ")) continue;
    double v = 0;
    if (absl::SimpleAtod(line, &v)) return v;
  }
  return -1;
}

// The leader on etcd killed with -9 in a steady job: every host's first
// beat sent after the kill answered (by the next leader), and no generation
// change. Adds its rows; non-zero on a failure (said on stderr).
int KillLeader(const std::string& dir, int processes, int hosts,
               testing::ReplicatedServers& servers, int leader, const std::string& mport,
               Table& table, nlohmann::ordered_json& result) {
  int round = -1;
  if (!testing::WaitFor(
          [&] {
            return (round = SteadyRound(dir, processes, hosts)) >= 0 &&
                   AnswersPrompt(dir, processes, Interval() / 2);
          },
          absl::Minutes(3))) {
    std::fprintf(stderr, "the job did not settle within 3 minutes before the leader's kill\n");
    return 1;
  }
  const double written = MetricsValue(mport, "zeroshard_etcd_state_written_bytes_total");
  const double writes = MetricsValue(mport, "zeroshard_etcd_state_writes_total");
  result["etcd_state_written_bytes"] = written;
  result["etcd_state_writes"] = writes;
  result["etcd_state_generations"] = round + 1;
  table.AddRow(
      {absl::StrCat("state written to etcd by the leader (joins, ", round + 1, " generations)"),
       absl::StrFormat("%.1f MB in %.0f writes", written / 1e6, writes), ""});
  // Every child marks the kill's time before it happens: a beat sent after
  // it counts.
  const int64_t kill_us = NowUs() + 1000000;
  for (int i = 0; i < processes; ++i) Command(dir, i, absl::StrCat("mark ", kill_us));
  auto all_marked = [&] {
    for (int i = 0; i < processes; ++i) {
      nlohmann::json st = nlohmann::json::parse(
          testing::ReadFileOrEmpty(absl::StrCat(dir, "/status-", i)), nullptr, false);
      if (st.is_discarded() || st.value("mark_us", int64_t{0}) != kill_us) return false;
    }
    return true;
  };
  if (!testing::WaitFor(all_marked, absl::Seconds(30))) {
    std::fprintf(stderr, "the simulators did not take the kill's mark\n");
    return 1;
  }
  absl::SleepFor(absl::FromUnixMicros(kill_us) - absl::Now());
  servers.server(leader)->Signal(SIGKILL);
  const absl::Time killed = absl::Now();
  const int next = servers.WaitLeader(absl::Minutes(1), leader);
  const double serving_s = absl::ToDoubleSeconds(absl::Now() - killed);
  int answered = 0;
  int64_t latest = 0;
  auto all_answered = [&] {
    answered = 0;
    latest = 0;
    for (int i = 0; i < processes; ++i) {
      nlohmann::json st = nlohmann::json::parse(
          testing::ReadFileOrEmpty(absl::StrCat(dir, "/status-", i)), nullptr, false);
      if (st.is_discarded()) continue;
      answered += st.value("answered_after_mark", 0);
      latest = std::max(latest, st.value("answered_after_mark_latest_us", int64_t{0}));
    }
    return answered == hosts;
  };
  const bool all = testing::WaitFor(all_answered, absl::Minutes(1));
  const Totals after = Collect(dir, processes, round);
  const double answered_s = (latest - absl::ToUnixMicros(killed)) / 1e6;
  // The new leader's own account: how long it took to load the state.
  std::string restored;
  for (absl::string_view line : absl::StrSplit(next >= 0 ? servers.Log(next) : "", '\n')) {
    if (absl::StrContains(line, "state restored from etcd")) restored = std::string(line);
  }
  result["leader_kill"] = {{"new_leader_serving_seconds", serving_s},
                           {"hosts_answered", answered},
                           {"every_host_answered_seconds", answered_s},
                           {"generation_changes", after.round.aborted},
                           {"new_leader_log", restored}};
  table.AddRow({"leader killed (-9): another server serving after",
                absl::StrFormat("%.2f s", serving_s), ""});
  table.AddRow({"  every host's next beat answered by the new leader",
                all ? absl::StrFormat("%.2f s (%d hosts)", answered_s, answered)
                    : absl::StrFormat("only %d of %d hosts in 60 s", answered, hosts),
                "<= 10 s"});
  table.AddRow({"  hosts told of a generation change", absl::StrCat(after.round.aborted), "0"});
  table.AddRow(
      {"  new leader: " + restored.substr(restored.find("state restored") == std::string::npos
                                              ? 0
                                              : restored.find("state restored")),
       "", ""});
  if (next >= 0) {
    const std::string next_mport =
        std::string(absl::StripPrefix(servers.metrics_address(next), "127.0.0.1:"));
    const double load_s = MetricsValue(next_mport, "zeroshard_etcd_state_load_seconds");
    result["leader_kill"]["state_load_seconds"] = load_s;
    table.AddRow({"  new leader's state load from etcd", absl::StrFormat("%.2f s", load_s), ""});
  }
  if (!all || after.round.aborted > 0) {
    std::fprintf(stderr, "after the leader's kill: %d of %d hosts answered, %d told of a change\n",
                 answered, hosts, after.round.aborted);
    return 1;
  }
  return 0;
}

int RunParent(const std::string& self) {
  const int hosts = absl::GetFlag(FLAGS_hosts);
  const int per_host = absl::GetFlag(FLAGS_ranks_per_host);
  const int processes = std::min(absl::GetFlag(FLAGS_processes), hosts);
  const int world = hosts * per_host;
  const int timeout_ms = absl::GetFlag(FLAGS_heartbeat_timeout_ms);
  if (const int interval_ms = absl::GetFlag(FLAGS_heartbeat_interval_ms);
      interval_ms < 1 || interval_ms >= timeout_ms) {
    std::fprintf(stderr,
                 "scale_bench: --heartbeat_interval_ms=%d: expected at least 1 and below "
                 "--heartbeat_timeout_ms (%d)\n",
                 interval_ms, timeout_ms);
    return 2;
  }
  BenchMachine machine = DescribeBenchMachine("");
  std::printf("%s\n", machine.Line().c_str());
  for (const std::string& list :
       {absl::GetFlag(FLAGS_server_cpus), absl::GetFlag(FLAGS_simulator_cpus)}) {
    if (list.empty()) continue;
    if (absl::StatusOr<cpu_set_t> set = ParseCpuList(list); !set.ok()) {
      std::fprintf(stderr, "scale_bench: %s\n", set.status().ToString().c_str());
      return 2;
    }
  }
  std::string binary = absl::GetFlag(FLAGS_server_binary);
  if (binary.empty()) binary = testing::RunfilePath("shard_server/shard_server");
  const std::string dir = testing::MakeTempDir("scale-bench");
  testing::RemovedAtExit dir_owner(dir);  // the children's logs
  std::vector<std::string> server_flags = {
      "--max_world_size=131072",
      absl::StrCat("--heartbeat_interval_ms=", absl::GetFlag(FLAGS_heartbeat_interval_ms)),
      absl::StrCat("--heartbeat_timeout_ms=", timeout_ms)};
  const int etcd_members = absl::GetFlag(FLAGS_etcd_members);
  if (etcd_members == 0) {
    server_flags.push_back("--metrics_listen=127.0.0.1:0");
    server_flags.push_back("--metrics_port_file=" + dir + "/mport");
  }
  for (const std::string& flag : absl::GetFlag(FLAGS_server_flags)) server_flags.push_back(flag);
  // The server measured: the lone one, or the leader on etcd.
  testing::ServerProcess server;
  std::unique_ptr<testing::EtcdCluster> etcd;
  std::unique_ptr<testing::ReplicatedServers> replicated;
  int leader = -1;
  std::string server_address, server_log_path;
  if (etcd_members == 0) {
    server = testing::StartServerProcess(binary, server_flags);
    server_address = server.address;
    server_log_path = server.dir + "/server.log";
  } else {
    // etcd's own default timing (the tests' 50/500 ms is for a quiet
    // loopback): a member starved for half a second must not start an
    // election of etcd's own.
    etcd = std::make_unique<testing::EtcdCluster>(
        dir + "/etcd", etcd_members, testing::OnHosts{},
        std::vector<std::string>{"--heartbeat-interval=100", "--election-timeout=1000"});
    if (!etcd->ok()) return 1;
    replicated = std::make_unique<testing::ReplicatedServers>(
        dir + "/servers", etcd->endpoints(), server_flags, absl::GetFlag(FLAGS_servers));
    leader = replicated->WaitLeader(absl::Minutes(1));
    if (leader < 0) {
      std::fprintf(stderr, "no shard server leads:\n%s\n", replicated->Log(0).c_str());
      return 1;
    }
    server_address = replicated->addresses();
    server_log_path = absl::StrCat(dir, "/servers/server-", leader, ".log");
    std::printf("etcd: %d members; %d shard servers, server %d leads\n", etcd_members,
                replicated->count(), leader);
  }
  testing::ChildProcess* const server_process =
      replicated != nullptr ? replicated->server(leader) : server.process.get();
  const pid_t pid = server_process->pid();
  const int64_t rss_idle = testing::RssBytes(pid);
  if (absl::Status pinned = PinProcess(pid, absl::GetFlag(FLAGS_server_cpus)); !pinned.ok()) {
    std::fprintf(stderr, "scale_bench: the server: %s\n", pinned.ToString().c_str());
    return 2;
  }

  std::vector<std::unique_ptr<testing::ChildProcess>> children;
  std::vector<int> first_host(processes + 1);
  for (int i = 0; i <= processes; ++i) first_host[i] = int64_t{hosts} * i / processes;
  auto process_of = [&](int host) {
    return static_cast<int>(std::upper_bound(first_host.begin(), first_host.end(), host) -
                            first_host.begin()) -
           1;
  };
  for (int i = 0; i < processes; ++i) {
    children.push_back(std::make_unique<testing::ChildProcess>(
        self,
        std::vector<std::string>{
            absl::StrCat("--child=", i), "--dir=" + dir, "--server=" + server_address,
            absl::StrCat("--first_host=", first_host[i]),
            absl::StrCat("--host_count=", first_host[i + 1] - first_host[i]),
            absl::StrCat("--hosts=", hosts), absl::StrCat("--ranks_per_host=", per_host),
            absl::StrCat("--heartbeat_timeout_ms=", timeout_ms),
            absl::StrCat("--heartbeat_interval_ms=", absl::GetFlag(FLAGS_heartbeat_interval_ms)),
            absl::StrCat("--connections_per_process=",
                         absl::GetFlag(FLAGS_connections_per_process)),
            "--telemetry=" + absl::GetFlag(FLAGS_telemetry),
            absl::StrCat("--same_member=", absl::GetFlag(FLAGS_same_member)),
            "--simulator_cpus=" + absl::GetFlag(FLAGS_simulator_cpus),
            absl::StrCat("--simulator_nice=", absl::GetFlag(FLAGS_simulator_nice))},
        absl::StrCat(dir, "/child-", i, ".log")));
  }
  Table table({"MEASURE", "VALUE", "TARGET"});
  // What was measured before the failure, then why.
  auto fail = [&](const std::string& what) {
    std::printf("%s", table.ToString().c_str());
    // The log read once: it grows between two reads (at 100K, ~140 MB).
    const std::string log = server_process->Log();
    std::fprintf(stderr, "%s\nserver log tail:\n%s\nchild 0:\n%s\n", what.c_str(),
                 log.substr(log.size() > 3000 ? log.size() - 3000 : 0).c_str(),
                 children[0]->Log().c_str());
    std::ofstream(dir + "/stop") << "stop\n";
    dir_owner.Keep();
    if (replicated == nullptr) server.dir_owner.Keep();
    return 1;
  };
  nlohmann::ordered_json result;
  result["machine"] = machine.Json();
  result["server_cpus"] = absl::GetFlag(FLAGS_server_cpus);
  result["simulator_cpus"] = absl::GetFlag(FLAGS_simulator_cpus);
  result["simulator_nice"] = absl::GetFlag(FLAGS_simulator_nice);
  result["etcd_members"] = etcd_members;
  result["same_member"] = absl::GetFlag(FLAGS_same_member);
  result["hosts"] = hosts;
  result["ranks"] = world;
  result["heartbeat_timeout_s"] = timeout_ms / 1000.0;
  result["heartbeat_interval_s"] = absl::ToDoubleSeconds(Interval());

  // ---- Join barrier: every agent sends its ranks' joins in one call ----
  // Every child's hosts connected (a real agent's connection is up long
  // before its ranks join).
  auto all_ready = [&] {
    for (int i = 0; i < processes; ++i) {
      if (testing::ReadFileOrEmpty(absl::StrCat(dir, "/ready-", i)).empty()) return false;
    }
    return true;
  };
  if (!testing::WaitFor(all_ready, absl::Minutes(5))) return fail("the children did not connect");
  const int64_t go = NowUs();
  std::ofstream(dir + "/go") << go << "\n";
  Totals t;
  if (!testing::WaitFor([&] { return (t = Collect(dir, processes, 0)).round.joined == hosts; },
                        absl::Minutes(5))) {
    return fail(absl::StrCat("join barrier: ", t.round.joined, " of ", hosts, " hosts joined"));
  }
  const double join_s = (t.round.joined_last_us - go) / 1e6;
  result["join_barrier_seconds"] = join_s;
  result["join_errors"] = t.round.join_errors;
  result["join_calls_retried"] = t.join_retries;
  table.AddRow({absl::StrCat("join barrier, ", world, " ranks (", hosts, " HostJoin calls)"),
                absl::StrFormat("%.2f s", join_s), "<= 10 s"});
  if (t.join_retries > 0) {
    table.AddRow({"  HostJoin calls broken and sent again", absl::StrCat(t.join_retries), "0"});
  }
  if (t.round.join_errors > 0) return fail("join errors: " + t.round.first_join_error);

  // ---- Every rank beats once an interval ----
  absl::SleepFor(3 * Interval());  // every host through its first beats
  const int64_t answers_start = Collect(dir, processes, 0).answers;
  const double cpu_start = testing::CpuSeconds(pid);
  const absl::Time measure_start = absl::Now();
  absl::SleepFor(absl::Seconds(absl::GetFlag(FLAGS_measure_seconds)));
  const double cpu_end = testing::CpuSeconds(pid);
  const double elapsed = absl::ToDoubleSeconds(absl::Now() - measure_start);
  t = Collect(dir, processes, 0);
  const double beats_per_s = (t.answers - answers_start) / elapsed;
  const double cores = (cpu_end - cpu_start) / elapsed;
  const int64_t rss = testing::RssBytes(pid);
  result["beats_per_second"] = beats_per_s;
  result["server_cores"] = cores;
  result["server_cpu_us_per_beat"] = cores * 1e6 / beats_per_s;
  result["server_rss_bytes"] = rss;
  result["server_rss_bytes_per_rank"] = double(rss - rss_idle) / world;
  result["beat_errors"] = t.errors;
  const int sockets = SocketsOpen(pid);
  result["server_sockets"] = sockets;
  table.AddRow({"server's open sockets (agents' TCP connections + its listeners)",
                absl::StrCat(sockets), ""});
  const double interval_s = absl::ToDoubleSeconds(Interval());
  table.AddRow({"rank beats answered per second", absl::StrFormat("%.0f", beats_per_s),
                absl::StrFormat("%.0f", world / interval_s)});
  table.AddRow(
      {absl::StrFormat("server CPU at %g-s heartbeats", interval_s),
       absl::StrFormat("%.2f cores (%.2f us per rank beat)", cores, cores * 1e6 / beats_per_s),
       "<= 1 core"});
  table.AddRow({"server RSS",
                absl::StrFormat("%.0f MiB (%.1f KiB per rank)", rss / 1048576.0,
                                double(rss - rss_idle) / world / 1024),
                "<= 2048 MiB"});
  if (t.errors > 0) return fail("beats refused: " + t.first_error);
  // Live ranks declared dead before the faults (the machine could not keep
  // up) make every rank re-join: the figures above may then include that
  // work, not only beats.
  const bool disturbed = t.round.aborted > 0;
  std::string first_dead_worker;  // of a disturbed run: whose silence it was, at the end
  DeathsInLog server_deaths(server_log_path);
  result["generation_changed_before_the_faults"] = disturbed;
  if (disturbed) {
    table.AddRow({"  live ranks declared dead before the faults: the job re-formed", "yes", "no"});
  }
  // The simulators' own lateness so far: a beat sent seconds after it was
  // due is a silence of the simulating machine, not of the server.
  result["simulator_beats_late_over_1s"] = t.late_over_1s;
  result["simulator_max_beat_late_seconds"] = t.max_late_us / 1e6;
  table.AddRow({"  simulators' beats sent > 1 s after due (latest)",
                absl::StrFormat("%d (%.2f s)", t.late_over_1s, t.max_late_us / 1e6), "0"});
  // ... and answers handled late, which set the next beat late.
  result["simulator_max_callback_late_seconds"] = t.max_probe_late_us / 1e6;
  table.AddRow({"  simulators' gRPC callbacks late (worst)",
                absl::StrFormat("%.2f s", t.max_probe_late_us / 1e6), ""});
  if (disturbed) {
    // Whose silence was it: the first death against the first beat the
    // simulators sent more than timeout - interval late.
    absl::Time first_death = absl::InfiniteFuture();
    for (const auto& [worker, death] : server_deaths.Update()) {
      if (death.at < first_death) {
        first_death = death.at;
        first_dead_worker = worker;
      }
    }
    const absl::Time barrier = absl::FromUnixMicros(t.round.joined_last_us);
    auto since_barrier = [&](absl::Time at) {
      if (at == absl::InfiniteFuture()) return std::string("none");
      const double s = absl::ToDoubleSeconds(at - barrier);
      return absl::StrFormat("%.2f s", s);
    };
    const absl::Time first_late = t.first_too_late_us == 0
                                      ? absl::InfiniteFuture()
                                      : absl::FromUnixMicros(t.first_too_late_us);
    if (first_death != absl::InfiniteFuture()) {
      result["first_death_after_barrier_seconds"] = absl::ToDoubleSeconds(first_death - barrier);
    }
    const absl::Time first_probe_late = t.first_probe_too_late_us == 0
                                            ? absl::InfiniteFuture()
                                            : absl::FromUnixMicros(t.first_probe_too_late_us);
    if (first_late != absl::InfiniteFuture()) {
      result["simulator_first_beat_too_late_after_barrier_seconds"] =
          absl::ToDoubleSeconds(first_late - barrier);
    }
    if (first_probe_late != absl::InfiniteFuture()) {
      result["simulator_first_callback_too_late_after_barrier_seconds"] =
          absl::ToDoubleSeconds(first_probe_late - barrier);
    }
    table.AddRow(
        {"  first death / simulators' first beat, callback timeout - interval late, after "
         "the barrier",
         since_barrier(first_death) + " / " + since_barrier(first_late) + ", " +
             since_barrier(first_probe_late),
         ""});
  }

  // ---- GET /metrics ----
  std::string mport =
      replicated != nullptr
          ? std::string(absl::StripPrefix(replicated->metrics_address(leader), "127.0.0.1:"))
          : std::string(absl::StripAsciiWhitespace(testing::ReadFileOrEmpty(dir + "/mport")));
  std::vector<double> times;
  int64_t bytes = 0;
  int failed = 0;
  std::string failure;
  for (int i = 0; i < 5; ++i) {
    auto [code, out] = testing::RunCommand(
        absl::StrCat("curl -sS -o ", dir, "/metrics.txt -w '%{time_total} %{size_download}' ",
                     "http://127.0.0.1:", mport, "/metrics 2>&1"));
    double seconds = 0;
    int64_t got = 0;
    std::vector<std::string> parts = absl::StrSplit(out, ' ');
    if (code != 0 || parts.size() != 2 || !absl::SimpleAtod(parts[0], &seconds) ||
        !absl::SimpleAtoi(parts[1], &got)) {
      // Said once: curl's exit code and message (a partial page, a reset).
      if (failure.empty()) failure = absl::StrCat("curl exit ", code, ": ", out);
      ++failed;
      continue;
    }
    bytes = got;
    times.push_back(seconds);
  }
  std::sort(times.begin(), times.end());
  const double metrics_s = times.empty() ? -1 : times[times.size() / 2];
  result["metrics_seconds"] = metrics_s;
  result["metrics_bytes"] = bytes;
  result["metrics_failed"] = failed;
  table.AddRow({absl::StrCat("GET /metrics (median of ", times.size(), " of 5)"),
                absl::StrFormat("%.3f s, %.2f MB", metrics_s, bytes / 1e6), "<= 1 s, <= 20 MB"});
  if (failed > 0) {
    table.AddRow(
        {absl::StrCat("  GET /metrics failed ", failed, " times"), failure.substr(0, 120), "0"});
  }

  // ---- A rank falls silent, then a host ----
  // Each: the server's time from the last beat to the death (its own
  // member_dead event's silent_ms), every survivor told (their agents'
  // next beats answered ABORT_GENERATION_CHANGED), every rank re-joined and
  // the next generation formed (the silent ones come back as restarted
  // processes at once).
  struct Fault {
    std::string name;
    int host;
    std::vector<std::string> workers;
  };
  const int rank_host = hosts / 3, lost_host = 2 * hosts / 3;
  std::vector<Fault> faults = {{"a silent rank", rank_host, {WorkerId(rank_host, 3)}},
                               {"a silent host (its agent)", lost_host, {}}};
  for (int s = 0; s < per_host; ++s) faults[1].workers.push_back(WorkerId(lost_host, s));
  std::vector<double> settled_s(faults.size(), 0);
  for (size_t f = 0; f < faults.size(); ++f) {
    const Fault& fault = faults[f];
    // The fault goes into a steady job: every host joined the latest round
    // and none was told of a change since (a fault sent while the hosts
    // re-join, live ranks declared dead on a machine that cannot keep up,
    // would be undone by the host's own re-join), and every answer of the
    // last second came back within half an interval: the server is not
    // behind. Right after a 100K-rank re-join it is, for seconds, and rule 4b
    // then holds a death by the lag on purpose (docs/multihost.md); that case
    // is the table's "settled" row, not the detection time.
    int round = -1;
    const absl::Time settle_from = absl::Now();
    if (!testing::WaitFor(
            [&] {
              return (round = SteadyRound(dir, processes, hosts)) >= 0 &&
                     AnswersPrompt(dir, processes, Interval() / 2);
            },
            absl::Minutes(3))) {
      return fail(fault.name + ": the job did not settle within 3 minutes");
    }
    settled_s[f] = absl::ToDoubleSeconds(absl::Now() - settle_from);
    const absl::Time since = absl::Now();
    Command(dir, process_of(fault.host),
            f == 0 ? absl::StrCat("silence-rank ", fault.host, " 3")
                   : absl::StrCat("silence-host ", fault.host));
    std::map<std::string, Death> deaths;
    auto all_dead = [&] {
      deaths = server_deaths.Update();
      for (const std::string& w : fault.workers) {
        if (deaths.count(w) == 0 || deaths[w].at < since - absl::Seconds(1)) return false;
      }
      return true;
    };
    if (!testing::WaitFor(all_dead, absl::Seconds(60))) {
      return fail(fault.name + ": not declared dead within 60 s");
    }
    double silent_s = 0;
    absl::Time last_beat = absl::InfiniteFuture();
    for (const std::string& w : fault.workers) {
      silent_s = std::max(silent_s, deaths[w].silent_s);
      last_beat = std::min(last_beat, deaths[w].at - absl::Seconds(deaths[w].silent_s));
    }
    if (f == 1) Command(dir, process_of(fault.host), absl::StrCat("replace-host ", fault.host));
    // Every host re-joins: those told, and the silent one (replaced).
    if (!testing::WaitFor(
            [&] { return (t = Collect(dir, processes, round + 1)).round.joined == hosts; },
            absl::Minutes(3))) {
      return fail(
          absl::StrCat(fault.name, ": ", t.round.joined, " of ", hosts, " hosts re-joined"));
    }
    const Round told = Collect(dir, processes, round).round;
    const double told_s = (told.aborted_last_us - absl::ToUnixMicros(last_beat)) / 1e6;
    const double formed_s = (t.round.joined_last_us - absl::ToUnixMicros(last_beat)) / 1e6;
    const std::string key = f == 0 ? "dead_rank" : "dead_host";
    result[key] = {
        {"detected_seconds", silent_s},         {"survivors_told_seconds", told_s},
        {"hosts_told", told.aborted},           {"next_generation_formed_seconds", formed_s},
        {"rejoin_errors", t.round.join_errors}, {"settled_before_fault_seconds", settled_s[f]}};
    table.AddRow({absl::StrCat(fault.name, ": declared dead after its last beat"),
                  absl::StrFormat("%.2f s", silent_s),
                  absl::StrFormat("<= %.1f s", timeout_ms / 1000.0 + 1)});
    table.AddRow({absl::StrFormat("  sent once the job had settled (answers within %g s), after",
                                  absl::ToDoubleSeconds(Interval() / 2)),
                  absl::StrFormat("%.2f s", settled_s[f]), ""});
    table.AddRow(
        {"  every survivor told (generation bumped)", absl::StrFormat("%.2f s", told_s), ""});
    table.AddRow({"  every rank re-joined, next generation formed",
                  absl::StrFormat("%.2f s", formed_s), ""});
  }
  if (replicated != nullptr) {
    if (int failed = KillLeader(dir, processes, hosts, *replicated, leader, mport, table, result);
        failed != 0) {
      return fail("the leader's kill: see above");
    }
  }
  std::ofstream(dir + "/stop") << "stop\n";
  for (auto& c : children) c->Wait(absl::Seconds(30));
  int first_dead_host = -1;
  if (!first_dead_worker.empty() &&
      std::sscanf(first_dead_worker.c_str(), "h%d/", &first_dead_host) == 1) {
    // The simulators' own account of that host's first generation.
    for (int i = 0; i < processes; ++i) {
      std::istringstream in(testing::ReadFileOrEmpty(absl::StrCat(dir, "/hosts-", i)));
      int host = 0;
      int64_t late_us = 0, rtt_us = 0;
      while (in >> host >> late_us >> rtt_us) {
        if (host != first_dead_host) continue;
        result["first_dead_host"] = {{"worker", first_dead_worker},
                                     {"beat_sent_late_seconds", late_us / 1e6},
                                     {"slowest_answer_seconds", rtt_us / 1e6}};
        table.AddRow({absl::StrCat("the first live rank declared dead (", first_dead_worker,
                                   "): its host's beats sent late / slowest answer"),
                      absl::StrFormat("%.2f s / %.2f s", late_us / 1e6, rtt_us / 1e6), ""});
      }
    }
  }
  if (replicated == nullptr) {
    server.process->Signal(SIGTERM);
    server.process->Wait(absl::Seconds(20));
  }
  std::printf("%s", table.ToString().c_str());
  return WriteBenchJson(result, absl::GetFlag(FLAGS_json_out));
}

}  // namespace
}  // namespace scale_bench
}  // namespace zeroshard

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  // Debian's Abseil checks every lock for cycles (~6 % of a simulator's
  // CPU); the server binary turns it off as well.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  if (absl::GetFlag(FLAGS_child) >= 0) return zeroshard::scale_bench::RunChild();
  char self[4096];
  ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (n <= 0) return 1;
  self[n] = '\0';
  return zeroshard::scale_bench::RunParent(self);
}
