// A shard_server process and shard_worker processes on loopback, for
// integration tests and benchmarks. Every process is killed on destruction.
#ifndef ZEROSHARD_TESTS_TESTING_CLUSTER_H_
#define ZEROSHARD_TESTS_TESTING_CLUSTER_H_

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/time/time.h"
#include "nlohmann/json.hpp"
#include "tests/testing/process.h"

namespace zeroshard::testing {

class EmulatedHosts;

// Where the processes run on emulated hosts (tests/testing/emulated_hosts.h):
// the server on `server_host`, worker r on worker_hosts[r], each listening
// and advertising its host's address.
struct HostLayout {
  EmulatedHosts* hosts = nullptr;  // not owned; null: everything on loopback
  int server_host = 0;
  std::vector<int> worker_hosts;
};

// Servers the test started itself (a replicated control plane on etcd:
// tests/testing/etcd_cluster.h), reached at `address` ("a:P,b:P,c:P").
struct ExternalServers {
  explicit ExternalServers(std::string servers) : address(std::move(servers)) {}
  std::string address;
};

class LocalCluster {
 public:
  // Workers only, for `servers` (no server of its own: server() is null,
  // RestartServer must not be called).
  LocalCluster(ExternalServers servers, const std::string& dir, HostLayout layout = {});
  // Starts the server (binary from runfiles unless given) with
  // --listen=127.0.0.1:0 (or its host's address), a port file, --state_dir
  // and --checkpoint_root under `dir`, plus `server_flags`. Fails the calling
  // test on error.
  LocalCluster(const std::string& dir, const std::vector<std::string>& server_flags = {},
               HostLayout layout = {});
  ~LocalCluster();

  bool ok() const { return !address_.empty(); }
  const std::string& address() const { return address_; }
  const std::string& dir() const { return dir_; }
  std::string checkpoint_root() const { return dir_ + "/checkpoints"; }
  ChildProcess* server() { return server_.get(); }
  // Stops the server with `signal` (SIGKILL: a crash), waits `gap`, and
  // starts it again on the same port and state directory.
  void RestartServer(int signal = 15 /* SIGTERM */, absl::Duration gap = absl::ZeroDuration());

  // With ZEROSHARD_TEST_VIA_AGENTS=1 in the environment (the *_via_agents
  // test targets: the direct-stream tests through node agents, issue #31),
  // every worker beats and joins through a shard_agent on its host
  // (docs/scale.md): one agent per worker host (or one on loopback), started
  // with the first workers there and kept for the cluster's life, cut off
  // with its host. A worker that went around its agent ("no node agent
  // answers") fails the test when the cluster goes.
  bool via_agents() const { return via_agents_; }
  // The same for the workers started from now on, whatever the environment.
  void UseAgents() { via_agents_ = true; }
  // The agent of `host` (-1: loopback's), or null before its first workers.
  ChildProcess* agent(int host);

  // Starts W workers of `job` (worker ids w0..w{W-1}, --host=127.0.0.1 or
  // their host's address,
  // --report=<dir>/<job>-{rank}.json, --checkpoint_dir=<checkpoint root>)
  // with `flags`. With ZEROSHARD_BACKEND=nccl in the environment, worker r
  // also gets --backend=nccl --local_rank=r (the GPU procedure).
  // `rank_flags[r]`, when given, are added for worker r only.
  void StartWorkers(const std::string& job, int world, const std::vector<std::string>& flags,
                    const std::map<int, std::vector<std::string>>& rank_flags = {});
  // Waits for every started worker; their exit codes (-1: still running at
  // the deadline, then killed).
  std::vector<int> WaitWorkers(absl::Duration timeout);
  // StartWorkers + WaitWorkers; true when all exited 0 (logs are printed
  // to stderr otherwise).
  bool Run(const std::string& job, int world, const std::vector<std::string>& flags,
           absl::Duration timeout = absl::Seconds(120));
  // The launcher's restart of worker `index` (of the last StartWorkers):
  // waits for the old process to be gone (killing it after `timeout`), then
  // starts it again with the same arguments (its worker id) plus `extra`; its
  // log goes to a new file, which WorkerLog(index) then reads.
  void RestartWorker(int index, const std::vector<std::string>& extra = {},
                     absl::Duration timeout = absl::Seconds(10));
  // Moves worker `index` to emulated host `host` (its --host too): its next
  // RestartWorker starts it there, a replacement on another machine.
  void MoveWorker(int index, int host);
  ChildProcess* worker(int rank) { return workers_[rank].get(); }
  std::string WorkerLog(int rank) const;
  nlohmann::json Report(const std::string& job, int rank) const;

 private:
  void StartServer();
  // A process on the host of the layout (`host` -1: the caller's).
  std::unique_ptr<ChildProcess> Launch(int host, const std::string& binary,
                                       const std::vector<std::string>& args,
                                       const std::string& log);
  // The layout's host of worker `index`, or -1.
  int WorkerHost(int index) const;
  std::string Loopback(int host) const;
  // --agent for a worker on `host` (via_agents_), its agent started first.
  std::vector<std::string> AgentFlags(int host);
  // Fails the test for each worker log that says it went around its agent.
  void ExpectEveryWorkerWentThroughItsAgent() const;

  struct Agent {
    std::unique_ptr<ChildProcess> process;
    std::string socket;  // its unix socket's path
  };

  std::string dir_;
  HostLayout layout_;
  std::vector<std::string> server_flags_;
  std::unique_ptr<ChildProcess> server_;
  std::string address_;
  int port_ = 0;
  int restarts_ = 0;
  std::vector<std::unique_ptr<ChildProcess>> workers_;
  std::vector<std::string> worker_logs_;
  std::vector<std::vector<std::string>> worker_args_;
  int worker_restarts_ = 0;
  std::vector<std::string> every_worker_log_;  // restarted workers' earlier ones too
  bool via_agents_;
  std::string agent_dir_;  // under /tmp: a unix socket path has at most 107 characters
  std::map<int, Agent> agents_;  // by host (-1: loopback)
};

}  // namespace zeroshard::testing

#endif  // ZEROSHARD_TESTS_TESTING_CLUSTER_H_
