#include "tests/testing/cluster.h"

#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "tests/testing/emulated_hosts.h"

namespace zeroshard::testing {
namespace {

bool ViaAgentsRequested() {
  const char* via = std::getenv("ZEROSHARD_TEST_VIA_AGENTS");
  return via != nullptr && std::string(via) == "1";
}

}  // namespace

LocalCluster::LocalCluster(const std::string& dir, const std::vector<std::string>& server_flags,
                           HostLayout layout)
    : dir_(dir),
      layout_(std::move(layout)),
      server_flags_(server_flags),
      via_agents_(ViaAgentsRequested()) {
  mkdir(dir_.c_str(), 0755);
  mkdir(checkpoint_root().c_str(), 0755);
  StartServer();
}

LocalCluster::LocalCluster(ExternalServers servers, const std::string& dir, HostLayout layout)
    : dir_(dir),
      layout_(std::move(layout)),
      address_(std::move(servers.address)),
      via_agents_(ViaAgentsRequested()) {
  mkdir(dir_.c_str(), 0755);
  mkdir(checkpoint_root().c_str(), 0755);
}

LocalCluster::~LocalCluster() {
  workers_.clear();
  if (via_agents_) ExpectEveryWorkerWentThroughItsAgent();
  for (auto& [host, agent] : agents_) {
    agent.process.reset();  // killed
    std::remove(agent.socket.c_str());
  }
  if (!agent_dir_.empty()) rmdir(agent_dir_.c_str());
  if (server_) {
    server_->Signal(SIGTERM);
    server_->Wait(absl::Seconds(5));
  }
}

std::unique_ptr<ChildProcess> LocalCluster::Launch(int host, const std::string& binary,
                                                   const std::vector<std::string>& args,
                                                   const std::string& log) {
  if (host < 0) return std::make_unique<ChildProcess>(binary, args, log);
  return layout_.hosts->Start(host, binary, args, log);
}

int LocalCluster::WorkerHost(int index) const {
  if (layout_.hosts == nullptr) return -1;
  return layout_.worker_hosts.at(index);
}

std::string LocalCluster::Loopback(int host) const {
  return host < 0 ? "127.0.0.1" : layout_.hosts->address(host);
}

ChildProcess* LocalCluster::agent(int host) {
  auto it = agents_.find(host);
  return it == agents_.end() ? nullptr : it->second.process.get();
}

std::vector<std::string> LocalCluster::AgentFlags(int host) {
  auto it = agents_.find(host);
  if (it == agents_.end()) {
    if (agent_dir_.empty()) {
      char dir[] = "/tmp/zs-agents-XXXXXX";
      if (mkdtemp(dir) == nullptr) ADD_FAILURE() << "mkdtemp " << dir << " failed";
      agent_dir_ = dir;
    }
    const std::string name = host < 0 ? std::string("loopback") : absl::StrCat("host", host);
    Agent agent;
    agent.socket = absl::StrCat(agent_dir_, "/", name, ".sock");
    agent.process = Launch(host, RunfilePath("agent/shard_agent"),
                           {"--server=" + address_, "--listen=unix:" + agent.socket},
                           absl::StrCat(dir_, "/agent-", name, ".log"));
    ChildProcess* process = agent.process.get();
    const std::string socket = agent.socket;
    if (!WaitFor([&] { return access(socket.c_str(), F_OK) == 0 || !process->running(); },
                 absl::Seconds(60)) ||
        !process->running()) {
      ADD_FAILURE() << "shard_agent on " << name << " did not start ("
                    << (process->running() ? DescribeProcess(process->pid()) : "it exited")
                    << "):\n"
                    << process->Log();
    }
    it = agents_.emplace(host, std::move(agent)).first;
  }
  return {"--agent=unix:" + it->second.socket};
}

void LocalCluster::ExpectEveryWorkerWentThroughItsAgent() const {
  for (const std::string& path : every_worker_log_) {
    const std::string log = ReadFileOrEmpty(path);
    EXPECT_EQ(log.find("no node agent answers"), std::string::npos)
        << path << ": the worker went around its agent:\n"
        << log;
  }
}

void LocalCluster::StartServer() {
  std::string port_file = absl::StrCat(dir_, "/port");
  std::remove(port_file.c_str());
  const int host = layout_.hosts == nullptr ? -1 : layout_.server_host;
  const std::string ip = Loopback(host);
  std::vector<std::string> args = {absl::StrCat("--listen=", ip, ":", port_),
                                   "--port_file=" + port_file, "--state_dir=" + dir_ + "/state",
                                   "--checkpoint_root=" + checkpoint_root()};
  args.insert(args.end(), server_flags_.begin(), server_flags_.end());
  for (std::string& flag : InsecureOffLoopback(ip, server_flags_)) args.push_back(flag);
  server_ = Launch(host, RunfilePath("shard_server/shard_server"), args,
                   absl::StrCat(dir_, "/server-", restarts_, ".log"));
  std::string port;
  // A server starts in ~50 ms; two CI runs saw one not write its port file
  // in 20 s with nothing in its log, each beside a test case that took 170
  // times its usual time (the machine, not the server, stalled: building
  // while testing on 2 cores). The deadline is for a server that cannot
  // start; what it was doing is printed if it passes.
  constexpr absl::Duration kStartDeadline = absl::Seconds(60);
  bool started = WaitFor(
      [&] {
        port = ReadFileOrEmpty(port_file);
        return (!port.empty() && port.back() == '\n') || !server_->running();
      },
      kStartDeadline);
  if (!started || port.empty()) {
    const bool still_running = server_->running();
    const std::string how =
        still_running ? absl::StrCat("still running ", absl::FormatDuration(kStartDeadline),
                                     " later without having written its port file; ",
                                     DescribeProcess(server_->pid()))
                      : absl::StrCat("exited with ", server_->Wait(absl::ZeroDuration()),
                                     " (128 + N: signal N)");
    ADD_FAILURE() << "shard_server did not start (--listen=" << ip << ":" << port_ << ", " << how
                  << "):\n"
                  << server_->Log();
    address_.clear();
    return;
  }
  port.pop_back();
  port_ = std::stoi(port);
  address_ = absl::StrCat(ip, ":", port_);
}

void LocalCluster::RestartServer(int signal, absl::Duration gap) {
  server_->Signal(signal);
  server_->Wait(absl::Seconds(10));
  // The restart gap is the scenario under test, not a wait for a condition.
  absl::SleepFor(gap);
  ++restarts_;
  StartServer();
}

void LocalCluster::StartWorkers(const std::string& job, int world,
                                const std::vector<std::string>& flags,
                                const std::map<int, std::vector<std::string>>& rank_flags) {
  workers_.clear();
  worker_logs_.clear();
  worker_args_.clear();
  for (int r = 0; r < world; ++r) {
    std::vector<std::string> args = {"--server=" + address_,
                                     "--job=" + job,
                                     absl::StrCat("--world_size=", world),
                                     absl::StrCat("--worker_id=w", r),
                                     "--host=" + Loopback(WorkerHost(r)),
                                     absl::StrCat("--report=", dir_, "/", job, "-{rank}.json"),
                                     "--checkpoint_dir=" + checkpoint_root()};
    // ZEROSHARD_BACKEND=nccl (tests/gpu/run.sh): the same tests on GPUs, one
    // per worker.
    const char* backend = std::getenv("ZEROSHARD_BACKEND");
    if (backend != nullptr && std::string(backend) == "nccl") {
      args.push_back("--backend=nccl");
      args.push_back(absl::StrCat("--local_rank=", r));
    }
    args.insert(args.end(), flags.begin(), flags.end());
    if (auto own = rank_flags.find(r); own != rank_flags.end()) {
      args.insert(args.end(), own->second.begin(), own->second.end());
    }
    if (via_agents_) {
      const std::vector<std::string> agent = AgentFlags(WorkerHost(r));
      args.insert(args.end(), agent.begin(), agent.end());
    }
    std::string log = absl::StrCat(dir_, "/", job, "-w", r, ".log");
    worker_logs_.push_back(log);
    every_worker_log_.push_back(log);
    worker_args_.push_back(args);
    workers_.push_back(Launch(WorkerHost(r), RunfilePath("worker/shard_worker"), args, log));
  }
}

void LocalCluster::RestartWorker(int index, const std::vector<std::string>& extra,
                                 absl::Duration timeout) {
  if (workers_[index]->Wait(timeout) == -1) {
    workers_[index]->Signal(SIGKILL);
    workers_[index]->Wait(absl::Seconds(10));
  }
  std::vector<std::string> args = worker_args_[index];
  args.insert(args.end(), extra.begin(), extra.end());
  worker_logs_[index] = absl::StrCat(dir_, "/w", index, "-restart", ++worker_restarts_, ".log");
  every_worker_log_.push_back(worker_logs_[index]);
  workers_[index] =
      Launch(WorkerHost(index), RunfilePath("worker/shard_worker"), args, worker_logs_[index]);
}

void LocalCluster::MoveWorker(int index, int host) {
  const std::string old_flag = "--host=" + Loopback(WorkerHost(index));
  layout_.worker_hosts.at(index) = host;
  for (std::string& arg : worker_args_[index]) {
    if (arg == old_flag) arg = "--host=" + Loopback(host);
  }
}

std::vector<int> LocalCluster::WaitWorkers(absl::Duration timeout) {
  absl::Time deadline = absl::Now() + timeout;
  std::vector<int> codes;
  for (auto& w : workers_) {
    absl::Duration left = std::max(deadline - absl::Now(), absl::ZeroDuration());
    int code = w->Wait(left);
    if (code == -1) w->Signal(SIGKILL);
    codes.push_back(code);
  }
  return codes;
}

bool LocalCluster::Run(const std::string& job, int world, const std::vector<std::string>& flags,
                       absl::Duration timeout) {
  StartWorkers(job, world, flags);
  std::vector<int> codes = WaitWorkers(timeout);
  bool ok = true;
  for (int r = 0; r < world; ++r) {
    if (codes[r] != 0) {
      ok = false;
      std::fprintf(stderr, "worker %d of job %s exited %d:\n%s\n", r, job.c_str(), codes[r],
                   WorkerLog(r).c_str());
    }
  }
  if (!ok) std::fprintf(stderr, "server log:\n%s\n", server_->Log().c_str());
  return ok;
}

std::string LocalCluster::WorkerLog(int rank) const { return ReadFileOrEmpty(worker_logs_[rank]); }

nlohmann::json LocalCluster::Report(const std::string& job, int rank) const {
  std::string text = ReadFileOrEmpty(absl::StrCat(dir_, "/", job, "-", rank, ".json"));
  return nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
}

}  // namespace zeroshard::testing
