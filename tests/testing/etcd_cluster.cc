#include "tests/testing/etcd_cluster.h"

#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "absl/container/flat_hash_set.h"
#include "absl/random/random.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "gtest/gtest.h"

namespace zeroshard::testing {
namespace {
constexpr char kEtcd[] = "/usr/bin/etcd";
constexpr char kEtcdctl[] = "/usr/bin/etcdctl";
}  // namespace

namespace {

// Whether `port` can be bound on 127.0.0.1 now.
bool Bindable(int port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return false;
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = htons(static_cast<uint16_t>(port));
  const bool ok = bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0;
  close(fd);
  return ok;
}

// The first port of the kernel's ephemeral range (ip_local_port_range).
int EphemeralStart() {
  std::ifstream in("/proc/sys/net/ipv4/ip_local_port_range");
  int low = 32768;
  in >> low;
  return low;
}

}  // namespace

// A port below the kernel's ephemeral range: a follower does not listen on
// its port, and a port the kernel may hand out (a bind to port 0, an
// outgoing connection's source) could be taken meanwhile by another test's
// process run beside this one, and a client of "all servers" would reach it
// Below that range a connection to a port nobody listens on can also never
// connect to itself (a TCP self-connect, when the kernel picks the target
// port as the source port). CI saw a join answered CANCELLED while no server
// led, after its connection succeeded: one of the two, probably.
int FreeLoopbackPort() {
  // Ports handed out before in this process are not handed out again: a
  // cluster asks for several before any is bound (two members on one port
  // was a CI failure).
  static absl::Mutex mu;
  static absl::BitGen* gen = new absl::BitGen;
  static absl::flat_hash_set<int>* given = new absl::flat_hash_set<int>;
  absl::MutexLock lock(&mu);
  const int high = std::min(EphemeralStart(), 65536);
  const int low = std::max(1024, high - 12000);
  for (int attempt = 0; attempt < 200; ++attempt) {
    const int port = absl::Uniform(*gen, low, high);
    if (!given->contains(port) && Bindable(port)) {
      given->insert(port);
      return port;
    }
  }
  return -1;
}

// etcd's data: in memory (/dev/shm) when it can be. etcd fsyncs every
// write, and on a shared machine whose disk is busy (CI, parallel builds) one
// fsync can take seconds: opening the backend alone took 16 s here, and lease
// renewals would time out. The tests are about the shard servers, not disks.
static std::string EtcdDataDir(const std::string& fallback) {
  char pattern[] = "/dev/shm/zeroshard-etcd-XXXXXX";
  if (mkdtemp(pattern) != nullptr) return pattern;
  return fallback;
}

std::string EtcdCluster::Url(int i, int port) const {
  const std::string host =
      placement_.hosts == nullptr ? "127.0.0.1" : placement_.hosts->address(placement_.on_hosts[i]);
  return absl::StrCat("http://", host, ":", port);
}

std::unique_ptr<ChildProcess> EtcdCluster::Launch(int i, const std::string& binary,
                                                  const std::vector<std::string>& args,
                                                  const std::string& log) {
  if (placement_.hosts == nullptr) return std::make_unique<ChildProcess>(binary, args, log);
  return placement_.hosts->Start(placement_.on_hosts[i], binary, args, log);
}

EtcdCluster::EtcdCluster(const std::string& dir, int members, OnHosts placement,
                         std::vector<std::string> etcd_flags)
    : dir_(dir), data_dir_(EtcdDataDir(dir + "/data")), placement_(std::move(placement)) {
  mkdir(dir_.c_str(), 0755);
  if (access(kEtcd, X_OK) != 0) {
    ADD_FAILURE() << kEtcd << " is missing: run tools/install_deps.sh (etcd-server)";
    return;
  }
  std::vector<int> peer_ports;
  std::vector<std::string> initial;
  for (int i = 0; i < members; ++i) {
    // On an emulated host of its own, etcd's standard ports.
    client_ports_.push_back(placement_.hosts == nullptr ? FreeLoopbackPort() : 2379);
    peer_ports.push_back(placement_.hosts == nullptr ? FreeLoopbackPort() : 2380);
    initial.push_back(absl::StrCat("e", i, "=", Url(i, peer_ports[i])));
  }
  for (int i = 0; i < members; ++i) {
    const std::string client = Url(i, client_ports_[i]);
    const std::string peer = Url(i, peer_ports[i]);
    std::vector<std::string> args = {
        absl::StrCat("--name=e", i), absl::StrCat("--data-dir=", data_dir_, "/e", i),
        "--listen-client-urls=" + client, "--advertise-client-urls=" + client,
        "--listen-peer-urls=" + peer, "--initial-advertise-peer-urls=" + peer,
        "--initial-cluster=" + absl::StrJoin(initial, ","), "--initial-cluster-state=new",
        "--initial-cluster-token=" + dir_,
        // Loopback: etcd's own elections within about half a second.
        "--heartbeat-interval=50", "--election-timeout=500", "--log-level=warn"};
    args.insert(args.end(), etcd_flags.begin(), etcd_flags.end());
    members_.push_back(Launch(i, kEtcd, args, absl::StrCat(dir_, "/etcd-e", i, ".log")));
  }
  ok_ = WaitFor([&] { return Etcdctl("endpoint health").first == 0; }, absl::Seconds(30));
  if (!ok_) ADD_FAILURE() << "etcd did not become healthy:\n" << members_[0]->Log();
}

EtcdCluster::~EtcdCluster() {
  for (auto& m : members_) {
    m->Signal(SIGCONT);  // a member a test left stopped
    m->Signal(SIGKILL);
    m->Wait(absl::Seconds(10));
  }
  std::error_code ignored;
  std::filesystem::remove_all(data_dir_, ignored);
}

std::string EtcdCluster::endpoints() const {
  std::vector<std::string> out;
  for (int i = 0; i < static_cast<int>(client_ports_.size()); ++i) {
    out.push_back(std::string(absl::StripPrefix(Url(i, client_ports_[i]), "http://")));
  }
  return absl::StrJoin(out, ",");
}

std::pair<int, std::string> EtcdCluster::Etcdctl(const std::string& arguments) const {
  const std::string command =
      absl::StrCat("ETCDCTL_API=3 ", kEtcdctl, " --endpoints=", endpoints(),
                   " --command-timeout=2s --dial-timeout=1s ", arguments, " 2>&1");
  if (placement_.hosts == nullptr) return RunCommand(command);
  // The emulated hosts' addresses exist only in their namespaces: ask from
  // a member's host, the first that answers (a test may have cut one off).
  std::pair<int, std::string> result = {-1, "no member host"};
  for (int k : placement_.on_hosts) {
    result = placement_.hosts->Run(k, command);
    if (result.first == 0) break;
  }
  return result;
}

std::string EtcdCluster::Get(const std::string& key) const {
  auto [code, out] = Etcdctl("get --print-value-only " + key);
  if (code != 0) return "";
  return std::string(absl::StripSuffix(out, "\n"));
}

// The integer field `name` of `etcdctl -w fields` output (0: none).
static int64_t FieldOf(const std::string& out, absl::string_view name) {
  const std::string prefix = absl::StrCat("\"", name, "\" : ");
  for (absl::string_view line : absl::StrSplit(out, '\n')) {
    if (absl::ConsumePrefix(&line, prefix)) {
      int64_t revision = 0;
      if (absl::SimpleAtoi(line, &revision)) return revision;
    }
  }
  return 0;
}

int64_t EtcdCluster::ModRevision(const std::string& key) const {
  auto [code, out] = Etcdctl("get -w fields " + key);
  return code == 0 ? FieldOf(out, "ModRevision") : 0;
}

int64_t EtcdCluster::Revision() const {
  // Any key's read reports the store's revision in its header.
  auto [code, out] = Etcdctl("get -w fields /");
  return code == 0 ? FieldOf(out, "Revision") : 0;
}

std::string ReplicatedServers::Host(int index) const {
  return placement_.hosts == nullptr ? "127.0.0.1"
                                     : placement_.hosts->address(placement_.on_hosts[index]);
}

std::unique_ptr<ChildProcess> ReplicatedServers::Launch(int index, const std::string& log) {
  const std::string binary = RunfilePath("shard_server/shard_server");
  if (placement_.hosts == nullptr) return std::make_unique<ChildProcess>(binary, args_[index], log);
  return placement_.hosts->Start(placement_.on_hosts[index], binary, args_[index], log);
}

ReplicatedServers::ReplicatedServers(const std::string& dir, const std::string& etcd_endpoints,
                                     const std::vector<std::string>& flags, int count,
                                     OnHosts placement)
    : dir_(dir), placement_(std::move(placement)) {
  mkdir(dir_.c_str(), 0755);
  for (int i = 0; i < count; ++i) {
    // On an emulated host of its own: fixed ports.
    ports_.push_back(placement_.hosts == nullptr ? FreeLoopbackPort() : 7070);
    metrics_ports_.push_back(placement_.hosts == nullptr ? FreeLoopbackPort() : 9090);
    std::vector<std::string> args = {
        absl::StrCat("--listen=", Host(i), ":", ports_[i]),
        absl::StrCat("--metrics_listen=", Host(i), ":", metrics_ports_[i]),
        "--etcd_endpoints=" + etcd_endpoints, absl::StrCat("--port_file=", dir_, "/port-", i)};
    args.insert(args.end(), flags.begin(), flags.end());
    for (std::string& flag : InsecureOffLoopback(Host(i), flags)) args.push_back(flag);
    args_.push_back(args);
    servers_.push_back(Launch(i, absl::StrCat(dir_, "/server-", i, ".log")));
  }
}

ReplicatedServers::~ReplicatedServers() {
  for (auto& s : servers_) {
    s->Signal(SIGCONT);  // a server a test left stopped
    s->Signal(SIGKILL);
    s->Wait(absl::Seconds(10));
  }
}

std::string ReplicatedServers::address(int index) const {
  return absl::StrCat(Host(index), ":", ports_[index]);
}

std::string ReplicatedServers::metrics_address(int index) const {
  return absl::StrCat(Host(index), ":", metrics_ports_[index]);
}

std::string ReplicatedServers::addresses() const {
  std::vector<std::string> out;
  for (int i = 0; i < count(); ++i) out.push_back(address(i));
  return absl::StrJoin(out, ",");
}

int ReplicatedServers::Leader(int other_than) {
  for (int i = 0; i < count(); ++i) {
    if (i == other_than || !servers_[i]->running()) continue;
    std::vector<int> listening = ListeningPorts(servers_[i]->pid());
    if (std::find(listening.begin(), listening.end(), ports_[i]) != listening.end()) return i;
  }
  return -1;
}

int ReplicatedServers::WaitLeader(absl::Duration timeout, int other_than) {
  int leader = -1;
  WaitFor(
      [&] {
        leader = Leader(other_than);
        return leader >= 0;
      },
      timeout);
  return leader;
}

std::string ReplicatedServers::LogLines(const std::vector<std::string>& needles) const {
  std::string out;
  for (int i = 0; i < count(); ++i) {
    for (absl::string_view line : absl::StrSplit(Log(i), '\n')) {
      for (const std::string& needle : needles) {
        if (absl::StrContains(line, needle)) {
          absl::StrAppend(&out, "server ", i, ": ", line, "\n");
          break;
        }
      }
    }
  }
  return out;
}

void ReplicatedServers::Restart(int index) {
  servers_[index] =
      Launch(index, absl::StrCat(dir_, "/server-", index, "-restart", ++restarts_, ".log"));
}

}  // namespace zeroshard::testing
