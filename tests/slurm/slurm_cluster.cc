#include "tests/slurm/slurm_cluster.h"

#include <errno.h>
#include <signal.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"

namespace zeroshard::testing {
namespace {

// The binaries the cluster runs and the Debian package of each.
constexpr std::pair<const char*, const char*> kTools[] = {
    {"slurmctld", "slurmctld"},
    {"slurmd", "slurmd"},
    {"slurmdbd", "slurmdbd"},
    {"sbatch", "slurm-client"},
    {"sacct", "slurm-client"},
    {"munged", "munge"},
    {"mariadbd", "mariadb-server"},
    {"mariadb-install-db", "mariadb-server"},
    {"ip", "iproute2"},
    {"nft", "nftables"},
};

std::string FindTool(const std::string& name) {
  for (const char* dir : {"/usr/sbin", "/usr/bin", "/sbin", "/bin"}) {
    std::string path = absl::StrCat(dir, "/", name);
    if (access(path.c_str(), X_OK) == 0) return path;
  }
  return "";
}

std::string Tail(const std::string& text, size_t lines) {
  std::vector<absl::string_view> all = absl::StrSplit(text, '\n');
  size_t from = all.size() > lines ? all.size() - lines : 0;
  return absl::StrJoin(all.begin() + from, all.end(), "\n");
}

// Daemons' ports (slurm.conf's defaults; each host has its own network).
constexpr int kMariadbPort = 3306;
constexpr int kSlurmctldPort = 6817;
constexpr int kSlurmdbdPort = 6819;
// Starting a daemon here takes well under a second; the bound is for a
// loaded 2-core CI runner, where `bazel test` runs two targets at a time.
constexpr absl::Duration kDaemonStartTimeout = absl::Seconds(60);

}  // namespace

std::string SlurmCluster::MissingRequirement() {
  if (geteuid() != 0) {
    return "the Slurm cluster needs root (network and UTS namespaces for its nodes); CI runs it "
           "as root";
  }
  std::vector<std::string> missing;
  for (const auto& [tool, package] : kTools) {
    if (FindTool(tool).empty()) missing.push_back(absl::StrCat(tool, " (", package, ")"));
  }
  if (missing.empty()) return "";
  return absl::StrCat("the Slurm cluster needs ", absl::StrJoin(missing, ", "),
                      ": run tools/install_deps.sh");
}

absl::StatusOr<std::unique_ptr<SlurmCluster>> SlurmCluster::Start(int hosts) {
  if (std::string missing = MissingRequirement(); !missing.empty()) {
    return absl::FailedPreconditionError(missing);
  }
  absl::StatusOr<std::unique_ptr<EmulatedHosts>> made = EmulatedHosts::Create(hosts);
  if (!made.ok()) return made.status();
  // Directories of runs whose process is gone (a crashed test; the hosts'
  // Create above killed what ran in their namespaces).
  RunCommand(
      "for d in /tmp/zsslurm-*-*; do p=${d#/tmp/zsslurm-}; p=${p%%-*}; "
      "[ -d \"$d\" ] && ! kill -0 \"$p\" 2>/dev/null && rm -rf \"$d\"; done");
  std::string dir_template = absl::StrCat("/tmp/zsslurm-", getpid(), "-XXXXXX");
  if (mkdtemp(dir_template.data()) == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat("mkdtemp ", dir_template, ": errno ", errno));
  }
  const std::string dir = dir_template;
  // Each node declares this machine's CPUs: slurmd drains a node that
  // declares more than it finds.
  const long cpus = std::max(1L, sysconf(_SC_NPROCESSORS_ONLN));
  auto [code, output] =
      RunCommand(absl::StrCat("/bin/bash ", RunfilePath("tests/slurm/configure_slurm.sh"), " ", dir,
                              " ", hosts, " ", cpus));
  std::unique_ptr<SlurmCluster> cluster(new SlurmCluster(*std::move(made), dir));
  if (code != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("tests/slurm/configure_slurm.sh exited ", code, ": ", output));
  }
  if (absl::Status s = cluster->StartDaemons(); !s.ok()) return s;
  return cluster;
}

SlurmCluster::~SlurmCluster() {
  // slurmctld first, so that it requeues nothing while the nodes go; the
  // hosts' destructor then kills what the slurmds left (steps, tasks).
  for (auto it = daemons_.rbegin(); it != daemons_.rend(); ++it) it->reset();
  daemons_.clear();
  hosts_.reset();
  RunCommand(absl::StrCat("rm -rf ", dir_));
}

ChildProcess& SlurmCluster::StartDaemon(int k, const std::string& name,
                                        const std::string& command) {
  daemons_.push_back(hosts_->Start(
      k, "/bin/sh", {"-c", absl::StrCat("export SLURM_CONF=", conf(), "; exec ", command)},
      absl::StrCat(dir_, "/log/", name, ".out")));
  return *daemons_.back();
}

absl::Status SlurmCluster::WaitListening(ChildProcess& daemon, const std::string& name, int port,
                                         absl::Duration timeout) {
  bool up = WaitFor(
      [&] {
        if (!daemon.running()) return true;
        std::vector<int> ports = ListeningPorts(daemon.pid());
        return std::find(ports.begin(), ports.end(), port) != ports.end();
      },
      timeout);
  if (up && daemon.running()) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      name, " did not listen on port ", port, " within ", absl::FormatDuration(timeout),
      (daemon.running() ? "" : " (it exited)"), "; its output:\n", Tail(daemon.Log(), 30)));
}

absl::Status SlurmCluster::StartDaemons() {
  const std::string run = dir_ + "/run";
  // One munged for every node: its socket is a file, reachable from every
  // network namespace (slurm.conf's AuthInfo names it).
  StartDaemon(0, "munged",
              absl::StrCat(FindTool("munged"), " --foreground --force --socket=", run,
                           "/munge.sock --key-file=", dir_, "/etc/munge.key --log-file=", dir_,
                           "/log/munged.log --pid-file=", run, "/munged.pid --seed-file=", run,
                           "/munged.seed"));
  // No grant tables: a database for one test run, reachable from host0 only.
  ChildProcess& mariadb = StartDaemon(
      0, "mariadbd",
      absl::StrCat(FindTool("mariadbd"), " --no-defaults --datadir=", dir_,
                   "/db --user=root --skip-grant-tables --bind-address=127.0.0.1 --port=",
                   kMariadbPort, " --socket=", run, "/mysql.sock --pid-file=", run,
                   "/mariadbd.pid --skip-log-bin --innodb-buffer-pool-size=32M"));
  if (absl::Status s = WaitListening(mariadb, "mariadbd", kMariadbPort, kDaemonStartTimeout);
      !s.ok()) {
    return s;
  }
  ChildProcess& dbd = StartDaemon(0, "slurmdbd", FindTool("slurmdbd") + " -D");
  if (absl::Status s = WaitListening(dbd, "slurmdbd", kSlurmdbdPort, kDaemonStartTimeout);
      !s.ok()) {
    return s;
  }
  ChildProcess& ctld = StartDaemon(0, "slurmctld", FindTool("slurmctld") + " -D -i");
  if (absl::Status s = WaitListening(ctld, "slurmctld", kSlurmctldPort, kDaemonStartTimeout);
      !s.ok()) {
    return s;
  }
  for (int k = 0; k < hosts_->size(); ++k) {
    StartDaemon(k, absl::StrCat("slurmd-", k),
                absl::StrCat(FindTool("slurmd"), " -D -N ", hosts_->hostname(k)));
  }
  bool idle = WaitFor(
      [&] {
        for (int k = 0; k < hosts_->size(); ++k) {
          if (NodeState(k) != "idle") {
            // sinfo in a namespace costs tens of ms of CPU: ask twice a second.
            absl::SleepFor(absl::Milliseconds(500));
            return false;
          }
        }
        return true;
      },
      kDaemonStartTimeout);
  if (!idle) {
    return absl::FailedPreconditionError(
        absl::StrCat("the nodes are not all idle after ", absl::FormatDuration(kDaemonStartTimeout),
                     ": ", Client("sinfo -N -o '%N %t %E'").second, "\n", Logs()));
  }
  return absl::OkStatus();
}

std::pair<int, std::string> SlurmCluster::Client(const std::string& command) {
  return hosts_->Run(0, absl::StrCat("export SLURM_CONF=", conf(), "; ", command));
}

std::vector<SacctRow> SlurmCluster::Sacct(const std::string& job_id) {
  auto [code, output] = Client(absl::StrCat("sacct -n -P -D -j ", job_id,
                                            " -o JobIDRaw,JobName,State,ExitCode,NodeList 2>&1"));
  std::vector<SacctRow> rows;
  if (code != 0) return rows;
  for (absl::string_view line : absl::StrSplit(output, '\n', absl::SkipEmpty())) {
    std::vector<std::string> f = absl::StrSplit(line, '|');
    if (f.size() != 5) continue;
    // "CANCELLED by 0": the state is the first word.
    std::string state = std::vector<std::string>(absl::StrSplit(f[2], ' '))[0];
    rows.push_back({f[0], f[1], state, f[3], f[4]});
  }
  return rows;
}

std::string SlurmCluster::JobField(const std::string& job_id, const std::string& field) {
  auto [code, output] = Client(absl::StrCat("scontrol -o show job ", job_id));
  if (code != 0) return "";
  for (absl::string_view word : absl::StrSplit(output, absl::ByAnyChar(" \n"))) {
    if (absl::ConsumePrefix(&word, field + "=")) return std::string(word);
  }
  return "";
}

std::string SlurmCluster::NodeState(int k) {
  // The whole list, not `sinfo -n <node>`: with -n, sinfo 22.05 showed a
  // node DOWN for 30 s as "mix*", its state before it went down.
  auto [code, output] = Client("sinfo -h -N -o '%N %t' 2>/dev/null");
  if (code != 0) return "";
  for (absl::string_view line : absl::StrSplit(output, '\n', absl::SkipEmpty())) {
    std::vector<std::string> f = absl::StrSplit(line, ' ', absl::SkipEmpty());
    if (f.size() == 2 && f[0] == hosts_->hostname(k)) return f[1];
  }
  return "";
}

void SlurmCluster::KillHost(int k) {
  auto [code, output] = RunCommand(absl::StrCat("ip netns pids ", hosts_->netns(k)));
  if (code != 0) return;
  for (absl::string_view line : absl::StrSplit(output, '\n', absl::SkipEmpty())) {
    int pid = 0;
    if (absl::SimpleAtoi(line, &pid) && pid > 1) kill(pid, SIGKILL);
  }
}

std::string SlurmCluster::Logs() const {
  std::string out;
  std::vector<std::string> logs = {"slurmctld.log", "slurmdbd.log"};
  for (int k = 0; k < hosts_->size(); ++k) logs.push_back(absl::StrCat("slurmd-host", k, ".log"));
  for (const std::string& log : logs) {
    absl::StrAppend(&out, "--- ", log, "\n", Tail(ReadFileOrEmpty(dir_ + "/log/" + log), 15), "\n");
  }
  return out;
}

}  // namespace zeroshard::testing
