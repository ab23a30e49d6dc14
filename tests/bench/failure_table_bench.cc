// docs/multihost.md's failure table, re-measured: each row's network fault
// made by deploy/emuhosts.sh (through tests/testing/emulated_hosts.h, the
// same tool a user reproduces the table with) on three emulated hosts, W = 4
// as 2 hosts x 2 ranks, the server alone on host 0, once with the flags the
// tests use ("tuned") and once with every failure-handling flag at its
// default ("defaults"). Needs root.
//
//   bazel-bin/tests/bench/failure_table_bench [--profiles=tuned,defaults]
//       [--rows=server_cut,...] [--outage=20s] [--give_up=8m] [--json_out=FILE]
//
// Rows (host 2 holds ranks 2 and 3; rank 0 is on host 1):
//   server_cut             host 0 (the server) cut off from everything for
//                          --outage, then healed
//   partition              host 2 cut from host 0 only for --outage, healed
//   partition_checkpoints  the same with --checkpoint_every=20
//   partition_unhealed     host 2 cut from host 0, never healed: until both
//                          cut-off ranks said so
//   host_cut_healed        host 2 cut off from everything for --outage
//   worker_killed          rank 1 killed (SIGKILL), started again at the
//                          server's verdict (the launcher's replacement)
//   host_cut_unhealed      host 2 cut off for good: until ranks 2 and 3 exit
//   server_unreachable     host 0 cut off before the workers start: until
//                          every worker said so, then until they exit
//                          (tuned: --join_timeout_s=60, the tests')
//   host_cut_replaced      host 2 cut off and its ranks killed; at the
//                          server's verdict the network is back and the
//                          launcher starts replacements (same worker ids)
//   host_cut_shrunk        the same with --min_world_size=2 (tuned: and
//                          --rejoin_grace=2s) and no replacement
//   host_cut_grown         host_cut_shrunk, then (10 steps at W = 2 later)
//                          the network back and the launcher's replacements
//                          started: until the server's grow_back and rank 0
//                          10 steps further at W = 4 (figures in the notes,
//                          from the replacements' start)
// Figures (seconds, from the fault, or from the heal where it says so):
//   generations   generation_bumped events after the fault (0: none)
//   first_dead_s  the server's first member_dead verdict
//   stall_s       the longest time rank 0 completed no step, fault -> end
//   beats_back_s  heal (the command's start) -> the last silent member's
//                 heartbeat_resumed
//   message_s     -> both cut-off ranks printed "has not answered a heartbeat"
//   exit_s        -> both cut-off ranks exited (host_cut_unhealed), and how
// The job itself: the MLP of the cluster tests (3 x 24, stage 3, batch 4),
// 100 ms a step (--test_step_delay_ms, so a fault lands mid-run), as many
// steps as the row needs (the row ends when its figures are in).
#include <signal.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "common/table.h"
#include "nlohmann/json.hpp"
#include "tests/testing/bench_json.h"
#include "tests/testing/cluster.h"
#include "tests/testing/emulated_hosts.h"
#include "tests/testing/process.h"

ABSL_FLAG(std::string, profiles, "tuned,defaults", "Flag profiles to run each row with");
ABSL_FLAG(std::string, rows,
          "server_cut,partition,partition_checkpoints,partition_unhealed,host_cut_healed,"
          "worker_killed,host_cut_replaced,host_cut_shrunk,host_cut_grown,host_cut_unhealed,server_"
          "unreachable",
          "Rows of the failure table to measure, in this order");
ABSL_FLAG(absl::Duration, outage, absl::Seconds(20), "How long a healed fault lasts");
ABSL_FLAG(absl::Duration, give_up, absl::Minutes(8),
          "How long a row waits for its figures after the fault");
ABSL_FLAG(std::string, json_out, "", "Write the results here as JSON");

namespace zeroshard {
namespace {

using testing::EmulatedHosts;
using testing::HostLayout;
using testing::LocalCluster;

constexpr int kServerHost = 0;
constexpr int kCutHost = 2;  // ranks 2 and 3

struct Profile {
  std::string name;
  std::vector<std::string> server_flags;
  std::vector<std::string> worker_flags;
};

// "tuned": what tests/cluster/across_hosts.cc gives the server and the
// recoverable runs (the figures the table had); "defaults": nothing.
Profile GetProfile(const std::string& name) {
  if (name == "tuned") {
    return {name,
            {"--heartbeat_interval_ms=300", "--heartbeat_timeout_ms=1500"},
            {"--collective_timeout=8s", "--snapshot_every=10", "--rejoin_timeout=60s"}};
  }
  if (name != "defaults") {
    std::fprintf(stderr, "--profiles: '%s' is not a profile; expected tuned or defaults\n",
                 name.c_str());
    std::exit(2);
  }
  return {name, {}, {}};
}

struct Figures {
  std::string row, profile;
  int generations = 0;
  double first_dead_s = -1, stall_s = -1, beats_back_s = -1, message_s = -1, exit_s = -1;
  std::string how;  // exit codes, or why a figure is missing
};

// The server's `event` lines at or after `since`: each one's time.
std::vector<absl::Time> ServerEvents(const std::string& log, const std::string& event,
                                     absl::Time since) {
  std::vector<absl::Time> times;
  std::istringstream lines(log);
  std::string line;
  while (std::getline(lines, line)) {
    if (line.find(" event=" + event + " ") == std::string::npos) continue;
    for (absl::string_view field : absl::StrSplit(line, ' ')) {
      absl::Time at;
      std::string error;
      if (absl::ConsumePrefix(&field, "ts=") &&
          absl::ParseTime("%Y-%m-%dT%H:%M:%E3SZ", field, absl::UTCTimeZone(), &at, &error) &&
          at >= since) {
        times.push_back(at);
      }
    }
  }
  return times;
}

// Rank 0's latest "step N/..." line (0: none yet). Only lines that start
// so: recovery lines also say "step N".
int LatestStep(const std::string& log) {
  const size_t at = log.rfind("\nstep ");
  const size_t slash = at == std::string::npos ? at : log.find('/', at);
  const size_t eol = at == std::string::npos ? at : log.find('\n', at + 1);
  int step = 0;
  if (slash == std::string::npos || slash > eol ||
      !absl::SimpleAtoi(log.substr(at + 6, slash - at - 6), &step)) {
    return 0;
  }
  return step;
}

void Must(const absl::Status& s) {
  if (s.ok()) return;
  std::fprintf(stderr, "%s\n", s.ToString().c_str());
  std::exit(1);
}

// One row's run: hosts, server, workers, and what is seen every 100 ms.
class Run {
 public:
  // `server_cut_first`: the server's host is cut off before the workers
  // start (the fault's start), and nobody waits for training.
  Run(const Profile& profile, const std::vector<std::string>& row_flags, bool server_cut_first) {
    auto hosts = EmulatedHosts::Create(3);
    if (!hosts.ok()) {
      std::fprintf(stderr, "%s\n", hosts.status().ToString().c_str());
      std::exit(1);
    }
    hosts_ = *std::move(hosts);
    cluster_ =
        std::make_unique<LocalCluster>(testing::MakeTempDir("failure-table"), profile.server_flags,
                                       HostLayout{hosts_.get(), kServerHost, {1, 1, 2, 2}});
    std::vector<std::string> flags = {
        "--model=mlp", "--layers=3", "--width=24", "--activation=relu", "--lr=0.01",
        "--seed=9",    "--stage=3",  "--batch=4",  "--steps=100000",    "--test_step_delay_ms=100"};
    flags.insert(flags.end(), profile.worker_flags.begin(), profile.worker_flags.end());
    flags.insert(flags.end(), row_flags.begin(), row_flags.end());
    if (server_cut_first) {
      Must(hosts_->CutOff(kServerHost));
      FaultNow();
    }
    cluster_->StartWorkers("table", 4, flags);
    if (server_cut_first) return;
    if (!Until([&] { return step_ >= 30; }, absl::Seconds(120))) {
      std::fprintf(stderr, "the job did not reach step 30:\n%s\n", cluster_->WorkerLog(0).c_str());
      std::exit(1);
    }
  }

  EmulatedHosts& hosts() { return *hosts_; }
  LocalCluster& cluster() { return *cluster_; }
  int step() const { return step_; }
  std::string ServerLog() const { return cluster_->server()->Log(); }

  // Marks the fault's start: stalls are measured from here.
  void FaultNow() {
    fault_ = absl::Now();
    last_step_at_ = fault_;
    stall_ = absl::ZeroDuration();
  }
  absl::Time fault() const { return fault_; }
  // Polls every 100 ms until `done` or `timeout`.
  bool Until(const std::function<bool()>& done, absl::Duration timeout) {
    const absl::Time deadline = absl::Now() + timeout;
    while (true) {
      Poll();
      if (done()) return true;
      if (absl::Now() > deadline) return false;
      absl::SleepFor(absl::Milliseconds(100));
    }
  }
  void For(absl::Duration d) {
    Until([] { return false; }, d);
  }
  // The longest stretch without a step since the fault, the current one
  // included.
  double StallSeconds() const {
    return absl::ToDoubleSeconds(std::max(stall_, absl::Now() - last_step_at_));
  }

 private:
  void Poll() {
    const int step = LatestStep(cluster_->WorkerLog(0));
    const absl::Time now = absl::Now();
    if (step != step_) {
      if (fault_ != absl::InfinitePast()) stall_ = std::max(stall_, now - last_step_at_);
      step_ = step;
      last_step_at_ = now;
    }
  }

  std::unique_ptr<EmulatedHosts> hosts_;
  std::unique_ptr<LocalCluster> cluster_;
  int step_ = 0;
  absl::Time fault_ = absl::InfinitePast();
  absl::Time last_step_at_ = absl::InfinitePast();
  absl::Duration stall_;
};

// Common figures from the server's log, after the row's own.
void ServerFigures(Run& run, Figures& f) {
  const std::string log = run.ServerLog();
  f.generations = ServerEvents(log, "generation_bumped", run.fault()).size();
  std::vector<absl::Time> dead = ServerEvents(log, "member_dead", run.fault());
  if (!dead.empty()) f.first_dead_s = absl::ToDoubleSeconds(dead.front() - run.fault());
  f.stall_s = run.StallSeconds();
}

// A fault for --outage, healed; ends when `silent_members` members beat
// again (0: they re-join instead, a new generation) and rank 0 made 10
// steps after the heal.
void MeasureHealed(Run& run, Figures& f, const std::function<absl::Status()>& fault,
                   int silent_members) {
  Must(fault());
  run.FaultNow();
  run.For(absl::GetFlag(FLAGS_outage));
  // From the heal command's start: the drops go while deploy/emuhosts.sh
  // still runs (a loaded machine's bash, flock and nft take up to ~1 s), and
  // heartbeats can resume before it returns.
  const absl::Time healed = absl::Now();
  Must(run.hosts().HealAll());
  const int step_at_heal = run.step();
  std::vector<absl::Time> resumed;
  const bool done = run.Until(
      [&] {
        resumed = ServerEvents(run.ServerLog(), "heartbeat_resumed", healed);
        return static_cast<int>(resumed.size()) >= silent_members &&
               run.step() >= step_at_heal + 10;
      },
      absl::GetFlag(FLAGS_give_up));
  if (silent_members > 0 && static_cast<int>(resumed.size()) >= silent_members) {
    std::sort(resumed.begin(), resumed.end());
    f.beats_back_s = absl::ToDoubleSeconds(resumed[silent_members - 1] - healed);
  }
  if (!done) f.how = absl::StrCat("rank 0 at step ", run.step(), " when given up");
}

// The server's host cut off before the workers start: until every worker
// said it cannot join, then until they gave up.
void MeasureUnreachable(Run& run, Figures& f) {
  auto said = [&](int r) {
    return run.cluster().WorkerLog(r).find("has not accepted it") != std::string::npos;
  };
  if (run.Until([&] { return said(0) && said(1) && said(2) && said(3); },
                absl::GetFlag(FLAGS_give_up))) {
    f.message_s = absl::ToDoubleSeconds(absl::Now() - run.fault());
  }
  auto gone = [&](int r) { return !run.cluster().worker(r)->running(); };
  if (run.Until([&] { return gone(0) && gone(1) && gone(2) && gone(3); },
                absl::GetFlag(FLAGS_give_up))) {
    f.exit_s = absl::ToDoubleSeconds(absl::Now() - run.fault());
    f.how = absl::StrCat("exit ", run.cluster().worker(0)->Wait(absl::ZeroDuration()));
  } else {
    f.how = "still joining when given up";
  }
}

// host_cut_grown: shrunk to W = 2 by a host cut, then the launcher's
// replacements; the figures (grow_back, 10 steps at W = 4) go to f.how.
void MeasureGrown(Run& run, Figures& f) {
  EmulatedHosts& hosts = run.hosts();
  const int step_at_cut = run.step();
  Must(hosts.CutOff(kCutHost));
  for (int r : {2, 3}) run.cluster().worker(r)->Signal(SIGKILL);  // gone
  run.FaultNow();
  // Shrunk to W = 2 and training: 10 steps past where it stopped.
  run.Until([&] { return run.step() >= step_at_cut + 10; }, absl::GetFlag(FLAGS_give_up));
  Must(hosts.HealAll());
  const absl::Time started = absl::Now();
  run.cluster().RestartWorker(2);
  run.cluster().RestartWorker(3);
  std::vector<absl::Time> grown;
  run.Until([&] { return !(grown = ServerEvents(run.ServerLog(), "grow_back", started)).empty(); },
            absl::GetFlag(FLAGS_give_up));
  const int step_at_grow = run.step();
  const bool trained =
      run.Until([&] { return run.step() >= step_at_grow + 10; }, absl::GetFlag(FLAGS_give_up));
  f.how =
      grown.empty()
          ? "no grow_back"
          : absl::StrFormat("grow_back %.1f s after the replacements started; %s",
                            absl::ToDoubleSeconds(grown.front() - started),
                            trained ? absl::StrFormat("10 steps at W = 4 by %.1f s",
                                                      absl::ToDoubleSeconds(absl::Now() - started))
                                    : "rank 0 did not train 10 steps after it");
}

void MeasureRow(const std::string& row, Run& run, Figures& f) {
  EmulatedHosts& hosts = run.hosts();
  if (row == "server_cut") {
    MeasureHealed(
        run, f, [&] { return hosts.CutOff(kServerHost); }, 4);
  } else if (row == "partition" || row == "partition_checkpoints") {
    MeasureHealed(
        run, f, [&] { return hosts.CutPair(kCutHost, kServerHost); }, 2);
  } else if (row == "host_cut_healed") {
    MeasureHealed(
        run, f, [&] { return hosts.CutOff(kCutHost); }, 0);
  } else if (row == "partition_unhealed") {
    Must(hosts.CutPair(kCutHost, kServerHost));
    run.FaultNow();
    auto said = [&](int r) {
      return run.cluster().WorkerLog(r).find("has not answered a heartbeat") != std::string::npos;
    };
    if (run.Until([&] { return said(2) && said(3); }, absl::GetFlag(FLAGS_give_up))) {
      f.message_s = absl::ToDoubleSeconds(absl::Now() - run.fault());
    }
  } else if (row == "worker_killed") {
    const int step_at_kill = run.step();
    run.cluster().worker(1)->Signal(SIGKILL);
    run.FaultNow();
    // The launcher replaces it at the verdict (a replacement started at once
    // would be a new incarnation's join: dead at once, whatever the rules).
    run.Until([&] { return !ServerEvents(run.ServerLog(), "member_dead", run.fault()).empty(); },
              absl::GetFlag(FLAGS_give_up));
    run.cluster().RestartWorker(1);
    // Training again: 10 steps past where it stopped.
    run.Until([&] { return run.step() >= step_at_kill + 10; }, absl::GetFlag(FLAGS_give_up));
  } else if (row == "host_cut_grown") {
    MeasureGrown(run, f);
  } else if (row == "host_cut_replaced" || row == "host_cut_shrunk") {
    const int step_at_cut = run.step();
    Must(hosts.CutOff(kCutHost));
    for (int r : {2, 3}) run.cluster().worker(r)->Signal(SIGKILL);  // gone for good
    run.FaultNow();
    if (row == "host_cut_replaced") {
      run.Until([&] { return !ServerEvents(run.ServerLog(), "member_dead", run.fault()).empty(); },
                absl::GetFlag(FLAGS_give_up));
      Must(hosts.HealAll());
      run.cluster().RestartWorker(2);
      run.cluster().RestartWorker(3);
    }
    // Training again (at W = 4, or W = 2): 10 steps past where it stopped.
    run.Until([&] { return run.step() >= step_at_cut + 10; }, absl::GetFlag(FLAGS_give_up));
  } else if (row == "server_unreachable") {
    MeasureUnreachable(run, f);
  } else if (row == "host_cut_unhealed") {
    Must(hosts.CutOff(kCutHost));
    run.FaultNow();
    auto gone = [&](int r) { return !run.cluster().worker(r)->running(); };
    if (run.Until([&] { return gone(2) && gone(3); }, absl::GetFlag(FLAGS_give_up))) {
      f.exit_s = absl::ToDoubleSeconds(absl::Now() - run.fault());
      const std::string log = run.cluster().WorkerLog(2);
      // "... (tried for 1m)": how long the re-join tried.
      const size_t at = log.rfind("tried for");
      const size_t end = at == std::string::npos ? at : log.find(')', at);
      f.how = absl::StrCat("exit ", run.cluster().worker(2)->Wait(absl::ZeroDuration()), "/",
                           run.cluster().worker(3)->Wait(absl::ZeroDuration()));
      if (end != std::string::npos) absl::StrAppend(&f.how, ", \"", log.substr(at, end - at), "\"");
    }
  } else {
    std::fprintf(stderr, "--rows: '%s' is not a row (see the file's comment)\n", row.c_str());
    std::exit(2);
  }
  ServerFigures(run, f);
}

std::string Seconds(double s) { return s < 0 ? "-" : absl::StrFormat("%.1f", s); }

int Main() {
  std::vector<Figures> all;
  for (absl::string_view p : absl::StrSplit(absl::GetFlag(FLAGS_profiles), ',')) {
    const Profile profile = GetProfile(std::string(p));
    for (absl::string_view r : absl::StrSplit(absl::GetFlag(FLAGS_rows), ',')) {
      const std::string row(r);
      std::vector<std::string> row_flags;
      if (row == "partition_checkpoints") row_flags = {"--checkpoint_every=20"};
      if (row == "server_unreachable" && profile.name == "tuned") {
        row_flags = {"--join_timeout_s=60"};  // the cluster tests'
      }
      if (row == "host_cut_shrunk" || row == "host_cut_grown") {
        row_flags = {"--min_world_size=2"};
        if (profile.name == "tuned") row_flags.push_back("--rejoin_grace=2s");  // elastic_test's
      }
      Figures f{row, profile.name};
      std::fprintf(stderr, "%s, %s ...\n", row.c_str(), profile.name.c_str());
      {
        Run run(profile, row_flags, row == "server_unreachable");
        MeasureRow(row, run, f);
      }
      std::printf(
          "%-22s %-8s generations %d, first dead %s s, stall %s s, beats back %s s, "
          "message %s s, exit %s s %s\n",
          f.row.c_str(), f.profile.c_str(), f.generations, Seconds(f.first_dead_s).c_str(),
          Seconds(f.stall_s).c_str(), Seconds(f.beats_back_s).c_str(), Seconds(f.message_s).c_str(),
          Seconds(f.exit_s).c_str(), f.how.c_str());
      std::fflush(stdout);
      all.push_back(f);
    }
  }
  Table table({"row", "profile", "generations", "first dead s", "rank 0 stall s",
               "beats back s (heal)", "message s", "exit s", "notes"});
  nlohmann::json json;
  json["outage_s"] = absl::ToDoubleSeconds(absl::GetFlag(FLAGS_outage));
  for (const Figures& f : all) {
    table.AddRow({f.row, f.profile, absl::StrCat(f.generations), Seconds(f.first_dead_s),
                  Seconds(f.stall_s), Seconds(f.beats_back_s), Seconds(f.message_s),
                  Seconds(f.exit_s), f.how});
    json["rows"].push_back({{"row", f.row},
                            {"profile", f.profile},
                            {"generations", f.generations},
                            {"first_dead_s", f.first_dead_s},
                            {"stall_s", f.stall_s},
                            {"beats_back_s", f.beats_back_s},
                            {"message_s", f.message_s},
                            {"exit_s", f.exit_s},
                            {"notes", f.how}});
  }
  std::printf("\n%s", table.ToString().c_str());
  return WriteBenchJson(json, absl::GetFlag(FLAGS_json_out));
}

}  // namespace
}  // namespace zeroshard

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return zeroshard::Main();
}
