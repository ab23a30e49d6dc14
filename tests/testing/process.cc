#include "tests/testing/process.h"

#include <dirent.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"

namespace zeroshard::testing {
namespace {

// Children not yet reaped, killed by an atexit handler: a test or benchmark
// that gives up with std::exit (its destructors do not run) leaves no server,
// etcd or worker behind.
absl::Mutex live_mu(absl::kConstInit);
std::set<pid_t>* live_children ABSL_GUARDED_BY(live_mu) = nullptr;

void KillLiveChildren() {
  absl::MutexLock lock(&live_mu);
  if (live_children == nullptr) return;
  for (pid_t pid : *live_children) {
    kill(-pid, SIGKILL);  // its process group: what it started, too
    kill(pid, SIGKILL);
  }
  live_children->clear();
}

void NoteLive(pid_t pid) {
  absl::MutexLock lock(&live_mu);
  if (live_children == nullptr) {
    live_children = new std::set<pid_t>;
    std::atexit(KillLiveChildren);
  }
  live_children->insert(pid);
}

void NoteGone(pid_t pid) {
  absl::MutexLock lock(&live_mu);
  if (live_children != nullptr) live_children->erase(pid);
}

}  // namespace

ChildProcess::ChildProcess(const std::string& binary, const std::vector<std::string>& args,
                           const std::string& log_path, const Placement& placement)
    : log_path_(log_path) {
  std::vector<char*> argv;
  argv.push_back(const_cast<char*>(binary.c_str()));
  for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  pid_ = fork();
  if (pid_ == 0) {
    int fd = open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd >= 0) {
      dup2(fd, 1);
      dup2(fd, 2);
    }
    // Its own process group: killed with what it started at exit (above).
    setpgid(0, 0);
    // Only system calls between fork and exec (the parent may have threads).
    if (placement.netns_fd >= 0 && setns(placement.netns_fd, CLONE_NEWNET) != 0) {
      std::perror("setns(CLONE_NEWNET)");
      _exit(126);
    }
    if (!placement.hostname.empty() &&
        (unshare(CLONE_NEWUTS) != 0 ||
         sethostname(placement.hostname.data(), placement.hostname.size()) != 0)) {
      std::perror("unshare(CLONE_NEWUTS)/sethostname");
      _exit(126);
    }
    execv(binary.c_str(), argv.data());
    std::perror("execv");
    _exit(127);
  }
  if (pid_ > 0) NoteLive(pid_);
}

ChildProcess::~ChildProcess() {
  if (pid_ > 0 && !reaped_) {
    kill(pid_, SIGKILL);
    waitpid(pid_, &status_, 0);
  }
  if (pid_ > 0) NoteGone(pid_);
}

void ChildProcess::Signal(int sig) {
  if (pid_ > 0 && !reaped_) kill(pid_, sig);
}

bool ChildProcess::running() {
  if (reaped_) return false;
  int status = 0;
  pid_t r = waitpid(pid_, &status, WNOHANG);
  if (r == pid_) {
    reaped_ = true;
    status_ = status;
    NoteGone(pid_);  // its pid may be reused: never killed at exit
    return false;
  }
  return true;
}

int ChildProcess::Wait(absl::Duration timeout) {
  absl::Time deadline = absl::Now() + timeout;
  while (running()) {
    if (absl::Now() > deadline) return -1;
    absl::SleepFor(absl::Milliseconds(10));
  }
  if (WIFEXITED(status_)) return WEXITSTATUS(status_);
  if (WIFSIGNALED(status_)) return 128 + WTERMSIG(status_);
  return -1;
}

std::string ChildProcess::Log() const { return ReadFileOrEmpty(log_path_); }

bool WaitFor(const std::function<bool()>& condition, absl::Duration timeout) {
  absl::Time deadline = absl::Now() + timeout;
  while (!condition()) {
    if (absl::Now() > deadline) return false;
    absl::SleepFor(absl::Milliseconds(10));
  }
  return true;
}

int64_t ProcStatusBytes(pid_t pid, const std::string& field) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  const std::string prefix = field + ":";
  while (std::getline(in, line)) {
    if (line.compare(0, prefix.size(), prefix) != 0) continue;
    int64_t kb = 0;
    std::string digits;
    for (char c : line.substr(prefix.size())) {
      if (c >= '0' && c <= '9') digits.push_back(c);
    }
    if (absl::SimpleAtoi(digits, &kb)) return kb * 1024;
  }
  return -1;
}

namespace {

std::string FirstLine(const std::string& text) { return text.substr(0, text.find('\n')); }

// "State:" of /proc/<pid>/task/<tid>/status, e.g. "D (disk sleep)".
std::string ThreadState(const std::string& task_dir) {
  for (absl::string_view line : absl::StrSplit(ReadFileOrEmpty(task_dir + "/status"), '\n')) {
    if (absl::ConsumePrefix(&line, "State:")) return std::string(absl::StripAsciiWhitespace(line));
  }
  return "?";
}

}  // namespace

std::string DescribeProcess(pid_t pid) {
  const std::string dir = absl::StrCat("/proc/", pid);
  std::string out = absl::StrCat("process ", pid, ":");
  char exe[512] = {0};
  const ssize_t n = readlink((dir + "/exe").c_str(), exe, sizeof(exe) - 1);
  absl::StrAppend(&out, " exe ", n > 0 ? std::string(exe, n) : "(unreadable)", "\n");
  absl::StrAppend(&out, "  loadavg ", FirstLine(ReadFileOrEmpty("/proc/loadavg")), "\n");
  for (absl::string_view line : absl::StrSplit(ReadFileOrEmpty("/proc/meminfo"), '\n')) {
    if (absl::StartsWith(line, "MemAvailable:") || absl::StartsWith(line, "Dirty:") ||
        absl::StartsWith(line, "Writeback:")) {
      absl::StrAppend(&out, "  ", line, "\n");
    }
  }
  DIR* tasks = opendir((dir + "/task").c_str());
  if (tasks == nullptr) return out + "  (no /proc entry: the process is gone)\n";
  int shown = 0;
  while (dirent* entry = readdir(tasks)) {
    if (entry->d_name[0] == '.') continue;
    if (++shown > 64) {
      absl::StrAppend(&out, "  (more threads not shown)\n");
      break;
    }
    const std::string task = dir + "/task/" + entry->d_name;
    absl::StrAppend(&out, "  thread ", entry->d_name, " ",
                    FirstLine(ReadFileOrEmpty(task + "/comm")), ": ", ThreadState(task), ", wchan ",
                    FirstLine(ReadFileOrEmpty(task + "/wchan")), ", syscall ",
                    FirstLine(ReadFileOrEmpty(task + "/syscall")), "\n");
    for (absl::string_view frame : absl::StrSplit(ReadFileOrEmpty(task + "/stack"), '\n')) {
      if (!frame.empty()) absl::StrAppend(&out, "      ", frame, "\n");
    }
  }
  closedir(tasks);
  return out;
}

std::vector<int> ListeningPorts(pid_t pid) {
  std::set<std::string> inodes;  // of the process's sockets
  const std::string fd_dir = absl::StrCat("/proc/", pid, "/fd");
  if (DIR* dir = opendir(fd_dir.c_str())) {
    while (dirent* entry = readdir(dir)) {
      char target[256] = {};
      const std::string link = fd_dir + "/" + entry->d_name;
      const ssize_t n = readlink(link.c_str(), target, sizeof(target) - 1);
      if (n <= 0) continue;
      absl::string_view t(target, static_cast<size_t>(n));
      if (absl::ConsumePrefix(&t, "socket:[")) inodes.insert(std::string(t.substr(0, t.find(']'))));
    }
    closedir(dir);
  }
  std::vector<int> ports;
  // The process's own network namespace's tables (an emulated host's).
  for (const char* table : {"tcp", "tcp6"}) {
    std::ifstream in(absl::StrCat("/proc/", pid, "/net/", table));
    std::string line;
    std::getline(in, line);  // the header
    while (std::getline(in, line)) {
      // sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode
      std::vector<std::string> f = absl::StrSplit(line, ' ', absl::SkipEmpty());
      if (f.size() < 10 || f[3] != "0A" || inodes.count(f[9]) == 0) continue;
      const std::string port_hex = f[1].substr(f[1].rfind(':') + 1);
      ports.push_back(static_cast<int>(std::stoul(port_hex, nullptr, 16)));
    }
  }
  return ports;
}

std::string MakeTempDir(const std::string& prefix) {
  const char* base = getenv("TEST_TMPDIR");
  std::string templ = absl::StrCat(base ? base : "/tmp", "/", prefix, "-XXXXXX");
  std::vector<char> buf(templ.begin(), templ.end());
  buf.push_back('\0');
  char* dir = mkdtemp(buf.data());
  return dir ? std::string(dir) : std::string();
}

RemovedAtExit::~RemovedAtExit() {
  if (dir_.empty() || std::getenv("ZEROSHARD_KEEP_BENCH_DIRS") != nullptr) return;
  std::error_code ignored;
  std::filesystem::remove_all(dir_, ignored);
}

void RemovedAtExit::Keep() {
  if (!dir_.empty()) std::fprintf(stderr, "kept for a look: %s\n", dir_.c_str());
  dir_.clear();
}

std::string ReadFileOrEmpty(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

void WriteFile(const std::string& path, const std::string& contents) {
  std::ofstream out(path, std::ios::binary);
  out << contents;
}

void WriteSecretFile(const std::string& path, const std::string& contents) {
  WriteFile(path, contents);
  chmod(path.c_str(), 0600);
}

std::vector<std::string> InsecureOffLoopback(const std::string& ip,
                                             const std::vector<std::string>& flags) {
  if (absl::StartsWith(ip, "127.") || ip == "::1" || ip == "localhost") return {};
  for (const std::string& flag : flags) {
    for (const char* auth :
         {"--auth_token_file=", "--job_tokens_dir=", "--tls_client_ca=", "--insecure"}) {
      if (absl::StartsWith(flag, auth)) return {};
    }
  }
  return {"--insecure"};
}

std::string RunfilePath(const std::string& workspace_relative) {
  const char* srcdir = getenv("TEST_SRCDIR");
  const char* workspace = getenv("TEST_WORKSPACE");
  if (srcdir != nullptr && workspace != nullptr) {
    return absl::StrCat(srcdir, "/", workspace, "/", workspace_relative);
  }
  // `bazel run` sets RUNFILES_DIR; a binary started by hand finds its
  // runfiles tree next to itself.
  if (const char* runfiles = getenv("RUNFILES_DIR")) {
    return absl::StrCat(runfiles, "/zeroshard/", workspace_relative);
  }
  char self[4096];
  ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (n > 0) {
    self[n] = '\0';
    std::string candidate = absl::StrCat(self, ".runfiles/zeroshard/", workspace_relative);
    if (access(candidate.c_str(), F_OK) == 0) return candidate;
  }
  return absl::StrCat("bazel-bin/", workspace_relative);
}

std::pair<int, std::string> RunCommand(const std::string& command) {
  std::string full = command + " 2>&1";
  FILE* pipe = popen(full.c_str(), "r");
  if (pipe == nullptr) return {-1, "popen failed"};
  std::string output;
  char buffer[4096];
  size_t n;
  while ((n = fread(buffer, 1, sizeof(buffer), pipe)) > 0) output.append(buffer, n);
  int status = pclose(pipe);
  int code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return {code, output};
}

}  // namespace zeroshard::testing
