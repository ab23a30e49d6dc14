#include "tests/testing/emulated_hosts.h"

#include <errno.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/strip.h"

namespace zeroshard::testing {
namespace {

constexpr char kNamePrefix[] = "zshosts-";
constexpr int kMaxHosts = 200;  // one /24, the bridge's side left out

std::string ShellQuote(const std::string& s) {
  return absl::StrCat("'", absl::StrReplaceAll(s, {{"'", "'\\''"}}), "'");
}

// deploy/emuhosts.sh, the user-facing tool that does the work (one
// implementation: the tests fault the hosts exactly as a user would).
std::string Script() { return "/bin/bash " + ShellQuote(RunfilePath("deploy/emuhosts.sh")); }

// Runs the script on set `name`; its error (which says what failed and why)
// when it exits non-zero.
absl::Status Emuhosts(const std::string& name, const std::string& arguments) {
  auto [code, output] =
      RunCommand(absl::StrCat(Script(), " --name ", ShellQuote(name), " ", arguments));
  if (code == 0) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat("deploy/emuhosts.sh ", arguments, " exited ",
                                                    code, ": ",
                                                    absl::StripTrailingAsciiWhitespace(output)));
}

}  // namespace

absl::StatusOr<std::unique_ptr<EmulatedHosts>> EmulatedHosts::Create(int count) {
  if (count < 1 || count > kMaxHosts) {
    return absl::InvalidArgumentError(
        absl::StrCat("emulated hosts: ", count, " hosts asked for; expected 1..", kMaxHosts));
  }
  if (geteuid() != 0) {
    return absl::FailedPreconditionError(
        "emulated hosts need root (network and UTS namespaces, nftables, tc): run the "
        "multi-host tests as root (CI does)");
  }
  // Sets of runs whose process is gone (a test that crashed before its
  // destructor ran).
  (void)RunCommand(Script() + " sweep");
  const std::string name = absl::StrCat(kNamePrefix, getpid());
  // A set of this pid left by an earlier object of this process.
  (void)Emuhosts(name, "down");
  std::unique_ptr<EmulatedHosts> hosts(new EmulatedHosts(name + "-", count));
  if (absl::Status s = hosts->Build(); !s.ok()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "cannot make emulated hosts (network namespaces on a bridge) here: ", s.message()));
  }
  return hosts;
}

absl::Status EmulatedHosts::Build() {
  if (absl::Status s = Emuhosts(name(), absl::StrCat("create ", count_, " --owner ", getpid()));
      !s.ok()) {
    return s;
  }
  for (int k = 0; k < count_; ++k) {
    const std::string path = absl::StrCat("/run/netns/", netns(k));
    int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      return absl::FailedPreconditionError(absl::StrCat("cannot open ", path, ": errno ", errno));
    }
    netns_fds_.push_back(fd);
  }
  return absl::OkStatus();
}

EmulatedHosts::~EmulatedHosts() {
  for (int fd : netns_fds_) close(fd);
  if (absl::Status s = Emuhosts(name(), "down"); !s.ok()) {
    std::fprintf(stderr, "emulated hosts: teardown: %s\n", std::string(s.message()).c_str());
  }
}

std::string EmulatedHosts::address(int k) const { return absl::StrCat("198.18.0.", k + 1); }
std::string EmulatedHosts::hostname(int k) const { return absl::StrCat("host", k); }
std::string EmulatedHosts::netns(int k) const { return absl::StrCat(prefix_, "h", k); }
std::string EmulatedHosts::name() const { return prefix_.substr(0, prefix_.size() - 1); }

std::unique_ptr<ChildProcess> EmulatedHosts::Start(int k, const std::string& binary,
                                                   const std::vector<std::string>& args,
                                                   const std::string& log_path) {
  return std::make_unique<ChildProcess>(binary, args, log_path,
                                        Placement{netns_fds_.at(k), hostname(k)});
}

std::pair<int, std::string> EmulatedHosts::Run(int k, const std::string& command) {
  return RunCommand(absl::StrCat(Script(), " --name ", ShellQuote(name()), " run ", k,
                                 " /bin/sh -c ", ShellQuote(command)));
}

absl::Status EmulatedHosts::AcceptTcpOnly(int k, int first, int last) {
  return Emuhosts(name(), absl::StrCat("firewall ", k, " ", first, " ", last));
}

absl::Status EmulatedHosts::RateLimit(int k, int64_t bits_per_second) {
  return Emuhosts(name(), absl::StrCat("rate ", k, " ", std::max<int64_t>(bits_per_second, 0)));
}

absl::Status EmulatedHosts::CutOff(int k) { return Emuhosts(name(), absl::StrCat("cut ", k)); }

absl::Status EmulatedHosts::CutPair(int a, int b) {
  return Emuhosts(name(), absl::StrCat("cut ", a, " --from ", b));
}

absl::Status EmulatedHosts::Heal(int k) { return Emuhosts(name(), absl::StrCat("heal ", k)); }

absl::Status EmulatedHosts::HealAll() { return Emuhosts(name(), "heal"); }

}  // namespace zeroshard::testing
