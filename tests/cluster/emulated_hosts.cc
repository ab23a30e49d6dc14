#include "tests/cluster/emulated_hosts.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace zeroshard::testing {
namespace {

constexpr char kNamePrefix[] = "zshosts-";
constexpr int kMaxHosts = 200;  // one /24, the bridge's side left out

// The absolute path of a system tool: tests run with a minimal PATH.
std::string Tool(const std::string& name) {
  for (const char* dir : {"/usr/sbin", "/sbin", "/usr/bin", "/bin"}) {
    std::string path = absl::StrCat(dir, "/", name);
    if (access(path.c_str(), X_OK) == 0) return path;
  }
  return name;
}

std::string ShellQuote(const std::string& s) {
  return absl::StrCat("'", absl::StrReplaceAll(s, {{"'", "'\\''"}}), "'");
}

// Runs `command`; an error naming what failed when it exits non-zero.
absl::Status Must(const std::string& what, const std::string& command) {
  auto [code, output] = RunCommand(command);
  if (code == 0) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(what, ": `", command, "` exited ", code, ": ",
                                                    absl::StripTrailingAsciiWhitespace(output)));
}

std::vector<std::string> ListNetns() {
  std::vector<std::string> names;
  auto [code, output] = RunCommand(Tool("ip") + " netns list");
  if (code != 0) return names;
  for (absl::string_view line : absl::StrSplit(output, '\n', absl::SkipEmpty())) {
    names.push_back(std::string(line.substr(0, line.find(' '))));
  }
  return names;
}

// Kills what runs in namespace `name` (started by a run of this tool) and
// deletes it.
void DeleteNetns(const std::string& name) {
  auto [code, output] = RunCommand(absl::StrCat(Tool("ip"), " netns pids ", name));
  if (code == 0) {
    for (absl::string_view pid : absl::StrSplit(output, '\n', absl::SkipEmpty())) {
      int value = 0;
      if (absl::SimpleAtoi(pid, &value) && value > 1) kill(value, SIGKILL);
    }
  }
  RunCommand(absl::StrCat(Tool("ip"), " netns del ", name));
}

// Namespaces of runs whose process is gone: a test that crashed before its
// destructor ran.
void SweepStale() {
  for (const std::string& name : ListNetns()) {
    if (name.rfind(kNamePrefix, 0) != 0) continue;
    absl::string_view rest = absl::string_view(name).substr(sizeof(kNamePrefix) - 1);
    int pid = 0;
    if (!absl::SimpleAtoi(rest.substr(0, rest.find('-')), &pid) || pid <= 0) continue;
    if (kill(pid, 0) == 0 || errno != ESRCH) continue;  // its run is alive
    DeleteNetns(name);
  }
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
  for (const char* tool : {"ip", "tc", "nft"}) {
    if (access(Tool(tool).c_str(), X_OK) != 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "emulated hosts need the '", tool, "' tool, not found: run tools/install_deps.sh"));
    }
  }
  SweepStale();
  std::unique_ptr<EmulatedHosts> hosts(
      new EmulatedHosts(absl::StrCat(kNamePrefix, getpid(), "-"), count));
  if (absl::Status s = hosts->Build(); !s.ok()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "cannot make emulated hosts (network namespaces on a bridge) here: ", s.message()));
  }
  return hosts;
}

absl::Status EmulatedHosts::Build() {
  const std::string ip = Tool("ip");
  const std::string br = bridge_netns();
  // A namespace of this pid left by an earlier object of this process.
  for (const std::string& name : ListNetns()) {
    if (name.rfind(prefix_, 0) == 0) DeleteNetns(name);
  }
  std::vector<std::string> commands = {
      absl::StrCat(ip, " netns add ", br),
      absl::StrCat(ip, " -n ", br, " link add br0 type bridge"),
      absl::StrCat(ip, " -n ", br, " link set br0 up"),
  };
  for (int k = 0; k < count_; ++k) {
    const std::string h = netns(k);
    const std::string port = absl::StrCat("v", k);
    commands.push_back(absl::StrCat(ip, " netns add ", h));
    commands.push_back(
        absl::StrCat(ip, " -n ", br, " link add ", port, " type veth peer name eth0 netns ", h));
    commands.push_back(absl::StrCat(ip, " -n ", br, " link set ", port, " master br0 up"));
    commands.push_back(absl::StrCat(ip, " -n ", h, " addr add ", address(k), "/24 dev eth0"));
    commands.push_back(absl::StrCat(ip, " -n ", h, " link set eth0 up"));
    commands.push_back(absl::StrCat(ip, " -n ", h, " link set lo up"));
  }
  for (const std::string& command : commands) {
    if (absl::Status s = Must("setting up the hosts", command); !s.ok()) return s;
  }
  // The drops: (source, destination) address pairs, on the bridge.
  const std::string ruleset =
      "table bridge zeroshard {\n"
      "  set cut { type ipv4_addr . ipv4_addr; }\n"
      "  chain forward {\n"
      "    type filter hook forward priority 0; policy accept;\n"
      "    ip saddr . ip daddr @cut drop\n"
      "  }\n"
      "}\n";
  if (absl::Status s = Must("the bridge's nftables table",
                            absl::StrCat("printf %s ", ShellQuote(ruleset), " | ", ip,
                                         " netns exec ", br, " ", Tool("nft"), " -f -"));
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
  for (int k = 0; k < count_; ++k) DeleteNetns(netns(k));
  DeleteNetns(bridge_netns());
}

std::string EmulatedHosts::address(int k) const { return absl::StrCat("198.18.0.", k + 1); }
std::string EmulatedHosts::hostname(int k) const { return absl::StrCat("host", k); }
std::string EmulatedHosts::netns(int k) const { return absl::StrCat(prefix_, "h", k); }

std::unique_ptr<ChildProcess> EmulatedHosts::Start(int k, const std::string& binary,
                                                   const std::vector<std::string>& args,
                                                   const std::string& log_path) {
  return std::make_unique<ChildProcess>(binary, args, log_path,
                                        Placement{netns_fds_.at(k), hostname(k)});
}

std::pair<int, std::string> EmulatedHosts::Run(int k, const std::string& command) {
  return RunCommand(
      absl::StrCat(Tool("ip"), " netns exec ", netns(k), " ", Tool("unshare"), " --uts /bin/sh -c ",
                   ShellQuote(absl::StrCat("hostname ", hostname(k), "; ", command))));
}

absl::Status EmulatedHosts::AcceptTcpOnly(int k, int first, int last) {
  const std::string ruleset = absl::StrCat(
      "table inet zeroshard_firewall {\n"
      "  chain input {\n"
      "    type filter hook input priority 0; policy accept;\n"
      "    iif lo accept\n"
      "    ct state new tcp dport != ",
      first, "-", last,
      " drop\n"
      "  }\n"
      "}\n");
  auto [code, output] = Run(k, absl::StrCat("printf %s ", ShellQuote(ruleset), " | ", Tool("nft"),
                                            " -f -"));
  if (code != 0) {
    return absl::InternalError(
        absl::StrCat("the firewall of ", hostname(k), " (nft) failed: ", output));
  }
  return absl::OkStatus();
}

absl::Status EmulatedHosts::RateLimit(int k, int64_t bits_per_second) {
  const std::string tc = Tool("tc");
  // Both ends: eth0 shapes what the host sends, the bridge's port what it
  // receives.
  const std::vector<std::pair<std::string, std::string>> ends = {
      {netns(k), "eth0"}, {bridge_netns(), absl::StrCat("v", k)}};
  for (const auto& [ns, dev] : ends) {
    if (bits_per_second <= 0) {
      // No qdisc of ours: nothing to delete.
      RunCommand(absl::StrCat(tc, " -n ", ns, " qdisc del dev ", dev, " root"));
      continue;
    }
    // 10 ms of traffic per burst, at least a few full frames.
    const int64_t burst = std::max<int64_t>(bits_per_second / 8 / 100, 16 * 1024);
    absl::Status s =
        Must(absl::StrCat("rate limit of host ", k),
             absl::StrCat(tc, " -n ", ns, " qdisc replace dev ", dev, " root tbf rate ",
                          bits_per_second, "bit burst ", burst, " latency 200ms"));
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status EmulatedHosts::CutOff(int k) {
  for (int j = 0; j < count_; ++j) {
    if (j == k) continue;
    cut_.insert({k, j});
    cut_.insert({j, k});
  }
  return ApplyCuts();
}

absl::Status EmulatedHosts::CutPair(int a, int b) {
  cut_.insert({a, b});
  cut_.insert({b, a});
  return ApplyCuts();
}

absl::Status EmulatedHosts::Heal(int k) {
  for (auto it = cut_.begin(); it != cut_.end();) {
    it = (it->first == k || it->second == k) ? cut_.erase(it) : std::next(it);
  }
  return ApplyCuts();
}

absl::Status EmulatedHosts::HealAll() {
  cut_.clear();
  return ApplyCuts();
}

absl::Status EmulatedHosts::ApplyCuts() {
  std::vector<std::string> pairs;
  for (const auto& [from, to] : cut_)
    pairs.push_back(absl::StrCat(address(from), " . ", address(to)));
  std::string script = "flush set bridge zeroshard cut\n";
  if (!pairs.empty()) {
    absl::StrAppend(&script, "add element bridge zeroshard cut { ", absl::StrJoin(pairs, ", "),
                    " }\n");
  }
  return Must("the bridge's drops",
              absl::StrCat("printf %s ", ShellQuote(script), " | ", Tool("ip"), " netns exec ",
                           bridge_netns(), " ", Tool("nft"), " -f -"));
}

}  // namespace zeroshard::testing
