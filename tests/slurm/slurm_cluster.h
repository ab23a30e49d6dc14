// A real Slurm cluster on emulated hosts (tests/testing/emulated_hosts.h):
// slurmctld, slurmdbd (over MariaDB, so that `sacct` answers) and munged on
// host0, one slurmd per host under the host's own name and address, all
// configured by tests/slurm/configure_slurm.sh under one directory. Nothing
// under /etc, /run or /var is touched.
//
// Every daemon runs inside an emulated host, so the hosts' destructor (which
// kills whatever runs in their namespaces) also ends the job steps slurmd
// started, whatever state a failed test left them in.
//
// Needs root and Debian's slurmctld, slurmd, slurmdbd, slurm-client, munge and
// mariadb-server (tools/install_deps.sh); MissingRequirement() names what is
// missing.
#ifndef ZEROSHARD_TESTS_SLURM_SLURM_CLUSTER_H_
#define ZEROSHARD_TESTS_SLURM_SLURM_CLUSTER_H_

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "tests/testing/emulated_hosts.h"
#include "tests/testing/process.h"

namespace zeroshard::testing {

// One row of `sacct -P -D`: a job (id "7"), its batch script ("7.batch") or
// a step ("7.0").
struct SacctRow {
  std::string id;
  std::string name;
  std::string state;      // COMPLETED, CANCELLED, NODE_FAIL, REQUEUED, ...
  std::string exit_code;  // "code:signal"
  std::string nodes;
};

class SlurmCluster {
 public:
  // "" when this machine can run the cluster; otherwise what is missing and
  // how to get it.
  static std::string MissingRequirement();

  // Configures `hosts` nodes in a fresh directory and starts every daemon;
  // returns once each node is idle in `sinfo`. The error says which daemon did
  // not come up, with its log. The directory is under /tmp, not TEST_TMPDIR:
  // munge's and MariaDB's socket paths must fit in 108 bytes. It is removed
  // with the cluster.
  static absl::StatusOr<std::unique_ptr<SlurmCluster>> Start(int hosts);
  ~SlurmCluster();
  SlurmCluster(const SlurmCluster&) = delete;
  SlurmCluster& operator=(const SlurmCluster&) = delete;

  EmulatedHosts& hosts() { return *hosts_; }
  const std::string& dir() const { return dir_; }
  std::string conf() const { return dir_ + "/etc/slurm.conf"; }

  // Runs a shell command line on host0 with SLURM_CONF set (sbatch, sacct,
  // scontrol, ...): (exit code, combined output).
  std::pair<int, std::string> Client(const std::string& command);

  // The job's rows in `sacct -D` (every run of a requeued job), oldest first.
  std::vector<SacctRow> Sacct(const std::string& job_id);
  // `scontrol show job` fields of the job, e.g. "JobState", "Restarts",
  // "NodeList"; "" when absent.
  std::string JobField(const std::string& job_id, const std::string& field);
  // The node's state in sinfo ("idle", "alloc", "down*", ...).
  std::string NodeState(int k);

  // The node dies: every process of host k (its slurmd, slurmstepd and the
  // tasks they run) killed with SIGKILL at once.
  void KillHost(int k);

  // The last lines of slurmctld's and each slurmd's log, for a failure message.
  std::string Logs() const;

 private:
  SlurmCluster(std::unique_ptr<EmulatedHosts> hosts, std::string dir)
      : hosts_(std::move(hosts)), dir_(std::move(dir)) {}
  absl::Status StartDaemons();
  // Starts `command` (a shell line run with SLURM_CONF set) on host k as a
  // daemon, output to dir/log/<name>.out.
  ChildProcess& StartDaemon(int k, const std::string& name, const std::string& command);
  // Waits until `daemon` listens on `port`, or says it did not with its log.
  absl::Status WaitListening(ChildProcess& daemon, const std::string& name, int port,
                             absl::Duration timeout);

  std::unique_ptr<EmulatedHosts> hosts_;
  const std::string dir_;
  std::vector<std::unique_ptr<ChildProcess>> daemons_;
};

}  // namespace zeroshard::testing

#endif  // ZEROSHARD_TESTS_SLURM_SLURM_CLUSTER_H_
