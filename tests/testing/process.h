// Test helpers: child processes that are always cleaned up, temporary
// directories, and waiting on a condition with a deadline.
#ifndef ZEROSHARD_TESTS_TESTING_PROCESS_H_
#define ZEROSHARD_TESTS_TESTING_PROCESS_H_

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "absl/time/time.h"

namespace zeroshard::testing {

// Where a child runs: in the network namespace open as `netns_fd` (-1: the
// caller's) and, when `hostname` is set, in a UTS namespace of its own under
// that name. tests/testing/emulated_hosts.h makes these for emulated hosts.
struct Placement {
  int netns_fd = -1;
  std::string hostname;
};

// A child process with stdout+stderr captured to a file. Killed (SIGKILL) and
// reaped on destruction if still running.
class ChildProcess {
 public:
  ChildProcess(const std::string& binary, const std::vector<std::string>& args,
               const std::string& log_path, const Placement& placement = {});
  ~ChildProcess();
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;

  pid_t pid() const { return pid_; }
  void Signal(int sig);
  // Waits up to `timeout` for the exit; returns the exit code, 128+signal, or
  // -1 on timeout.
  int Wait(absl::Duration timeout);
  bool running();
  std::string Log() const;

 private:
  pid_t pid_ = -1;
  bool reaped_ = false;
  int status_ = 0;
  std::string log_path_;
};

// Polls `condition` every 10 ms until it holds or `timeout` passes.
bool WaitFor(const std::function<bool()>& condition, absl::Duration timeout);

// A byte figure of /proc/<pid>/status, e.g. "VmRSS" or "VmHWM" (reported in
// kB there); -1 if the process or the field is not there.
int64_t ProcStatusBytes(pid_t pid, const std::string& field);

// What a process that does not answer is doing, for a failure message: the
// binary it runs (a child stuck between fork and exec still runs the test's),
// the load and memory of the machine, and per thread its state (R running, S
// sleeping, D waiting on the disk), the kernel function it waits in, its
// system call, and its kernel stack where /proc lets us read it (root).
std::string DescribeProcess(pid_t pid);

// The TCP ports (IPv4 and IPv6) process `pid` listens on, from /proc (its
// sockets' inodes against /proc/<pid>/net/tcp{,6}: its own network
// namespace's, an emulated host's included).
std::vector<int> ListeningPorts(pid_t pid);

// A fresh directory under TEST_TMPDIR (or /tmp).
std::string MakeTempDir(const std::string& prefix);

// Removes a benchmark's directory (its logs: hundreds of MB at 100K ranks)
// when it goes, unless Keep() was called (a failed run's evidence, said on
// stderr) or ZEROSHARD_KEEP_BENCH_DIRS is set. Tests need none: Bazel
// empties TEST_TMPDIR.
class RemovedAtExit {
 public:
  RemovedAtExit() = default;
  explicit RemovedAtExit(std::string dir) : dir_(std::move(dir)) {}
  RemovedAtExit(RemovedAtExit&& other) noexcept : dir_(std::move(other.dir_)) { other.dir_.clear(); }
  RemovedAtExit& operator=(RemovedAtExit&& other) noexcept {
    std::swap(dir_, other.dir_);
    return *this;
  }
  ~RemovedAtExit();
  void Keep();

 private:
  std::string dir_;
};

std::string ReadFileOrEmpty(const std::string& path);
void WriteFile(const std::string& path, const std::string& contents);
// WriteFile, then mode 0600: a token file the server and clients accept
// (common/secret_file.h).
void WriteSecretFile(const std::string& path, const std::string& contents);

// Path of a binary built by Bazel, from the test's runfiles (e.g.
// "shard_server/shard_server").
std::string RunfilePath(const std::string& workspace_relative);
// {"--insecure"} for a shard_server listening on `ip` when that is not a
// loopback address (an emulated host's 198.18.x.x) and `flags` give it no
// authentication (--auth_token_file, --job_tokens_dir, --tls_client_ca) nor
// --insecure already: such a server refuses to start otherwise. {} if not.
std::vector<std::string> InsecureOffLoopback(const std::string& ip,
                                             const std::vector<std::string>& flags);

// Runs a command line via /bin/sh, returns (exit code, combined output).
std::pair<int, std::string> RunCommand(const std::string& command);

}  // namespace zeroshard::testing

#endif  // ZEROSHARD_TESTS_TESTING_PROCESS_H_
