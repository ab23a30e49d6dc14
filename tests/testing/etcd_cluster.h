// A real etcd cluster (Debian's etcd-server) and several shard servers on it,
// on free loopback ports (etcd's data in /dev/shm, logs in the test's directory), for the
// replicated control plane's tests (tests/ha) and benchmarks. Every process
// is killed on destruction, also when the test fails.
#ifndef ZEROSHARD_TESTS_TESTING_ETCD_CLUSTER_H_
#define ZEROSHARD_TESTS_TESTING_ETCD_CLUSTER_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "tests/testing/emulated_hosts.h"
#include "tests/testing/process.h"

namespace zeroshard::testing {

// A TCP port on 127.0.0.1 that was free a moment ago, never one returned
// before in this process.
int FreeLoopbackPort();

// Where processes run: on loopback (hosts null), or member/server i on
// emulated host on_hosts[i] (its address, etcd's and the servers' standard
// ports).
struct OnHosts {
  EmulatedHosts* hosts = nullptr;  // not owned
  std::vector<int> on_hosts;
};

class EtcdCluster {
 public:
  // Starts `members` etcd processes forming one cluster and waits until it
  // serves (fails the calling test otherwise).
  // `etcd_flags` go to every member (e.g. "--quota-backend-bytes=...").
  explicit EtcdCluster(const std::string& dir, int members = 3, OnHosts placement = {},
                       std::vector<std::string> etcd_flags = {});
  ~EtcdCluster();

  bool ok() const { return ok_; }
  // "127.0.0.1:P1,127.0.0.1:P2,...": every member's client URL.
  std::string endpoints() const;
  ChildProcess* member(int index) { return members_[index].get(); }
  // `etcdctl` with the cluster's endpoints: exit code and output.
  std::pair<int, std::string> Etcdctl(const std::string& arguments) const;
  // The value of `key` ("" when absent or etcd cannot answer).
  std::string Get(const std::string& key) const;
  // Etcd's current revision: it grows by one with every write (0: no answer).
  int64_t Revision() const;
  // Etcd's revision of `key`'s last change (0: absent or no answer).
  int64_t ModRevision(const std::string& key) const;

 private:
  // "http://HOST:PORT" of member i's client or peer side.
  std::string Url(int i, int port) const;
  std::unique_ptr<ChildProcess> Launch(int i, const std::string& binary,
                                       const std::vector<std::string>& args,
                                       const std::string& log);

  std::string dir_;       // logs
  std::string data_dir_;  // the members' data (removed on destruction)
  OnHosts placement_;
  std::vector<int> client_ports_;
  std::vector<std::unique_ptr<ChildProcess>> members_;
  bool ok_ = false;
};

// `count` shard servers with the same --etcd_endpoints, each on its own
// loopback port; only the leader listens.
class ReplicatedServers {
 public:
  ReplicatedServers(const std::string& dir, const std::string& etcd_endpoints,
                    const std::vector<std::string>& flags, int count = 3, OnHosts placement = {});
  ~ReplicatedServers();

  // Every server's address, comma-separated: what clients are given.
  std::string addresses() const;
  std::string address(int index) const;
  // HOST:PORT of server `index`'s metrics port (--metrics_listen): the
  // leader's /metrics, or a follower's own.
  std::string metrics_address(int index) const;
  ChildProcess* server(int index) { return servers_[index].get(); }
  int count() const { return static_cast<int>(servers_.size()); }
  // The index of a server that listens on its port (leads), or -1; server
  // `other_than` is not asked (a paused one still has its socket).
  int Leader(int other_than = -1);
  // Waits until a server other than `other_than` leads; its index or -1.
  int WaitLeader(absl::Duration timeout, int other_than = -1);
  // Starts server `index` again (after it was killed), same arguments.
  void Restart(int index);
  std::string Log(int index) const { return servers_[index]->Log(); }
  // Every server's log lines that hold one of `needles` (e.g.
  // "event=member_dead"), each prefixed "server I: ": why a generation
  // changed or who led, for a failed test's message.
  std::string LogLines(const std::vector<std::string>& needles) const;

 private:
  std::string Host(int index) const;
  std::unique_ptr<ChildProcess> Launch(int index, const std::string& log);

  std::string dir_;
  OnHosts placement_;
  std::vector<int> ports_;
  std::vector<int> metrics_ports_;
  std::vector<std::vector<std::string>> args_;
  std::vector<std::unique_ptr<ChildProcess>> servers_;
  int restarts_ = 0;
};

}  // namespace zeroshard::testing

#endif  // ZEROSHARD_TESTS_TESTING_ETCD_CLUSTER_H_
