// Emulated hosts: N "machines" on one Linux box, for tests and benchmarks of
// what crosses the node boundary.
//
// Host k is a network namespace with one interface, eth0, at 198.18.0.(k+1)/24
// (RFC 2544's benchmarking range: it exists only inside these namespaces),
// and a process started on it gets a UTS namespace of its own named
// "host<k>" (a worker tells hosts apart by hostname + boot id). Each eth0 is
// one end of a veth pair whose other end is a port of a bridge living in a
// namespace of its own: nothing is added to the caller's namespace.
//
//     host0 [eth0 198.18.0.1] ─ v0 ┐
//     host1 [eth0 198.18.0.2] ─ v1 ┼─ br0   (namespace <prefix>br)
//     host2 [eth0 198.18.0.3] ─ v2 ┘
//
// The work is done by deploy/emuhosts.sh (set "zshosts-<pid>"), the tool a
// user reproduces these faults with: the tests and the docs' figures fault
// hosts the same way. Faults, all on the path between hosts, never inside one:
//   RateLimit  tbf on both ends of the host's veth (its uplink and downlink);
//   CutOff     every packet between the host and any other dropped on the
//              bridge (nftables, bridge family): silent both ways, no FIN, RST
//              or ICMP, and the host's own sockets see no error either (a drop
//              in the host's OUTPUT hook would fail its connect() with EPERM);
//   CutPair    the same for one pair of hosts (a partition);
//   Heal       undoes the cuts that involve a host; HealAll every cut.
//
// Lifetime. Names carry a per-run prefix, "zshosts-<pid>-"; the destructor
// kills what runs on the hosts and deletes the namespaces (`emuhosts.sh
// down`), and Create first sweeps sets whose creating process is gone (a
// crashed test: `emuhosts.sh sweep`).
//
// Needs root (CAP_SYS_ADMIN, CAP_NET_ADMIN) and the ip, tc and nft tools
// (tools/install_deps.sh); Create says which is missing otherwise (the
// script's message).
// Not thread-safe.
#ifndef ZEROSHARD_TESTS_TESTING_EMULATED_HOSTS_H_
#define ZEROSHARD_TESTS_TESTING_EMULATED_HOSTS_H_

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "tests/testing/process.h"

namespace zeroshard::testing {

class EmulatedHosts {
 public:
  // Makes `count` hosts (1..200). FAILED_PRECONDITION, saying what could not
  // be made and why, when namespaces cannot be made here.
  static absl::StatusOr<std::unique_ptr<EmulatedHosts>> Create(int count);
  // Kills every process left on the hosts and deletes the namespaces.
  ~EmulatedHosts();
  EmulatedHosts(const EmulatedHosts&) = delete;
  EmulatedHosts& operator=(const EmulatedHosts&) = delete;

  int size() const { return count_; }
  // 198.18.0.(k+1)
  std::string address(int k) const;
  // "host<k>": the hostname processes on host k see.
  std::string hostname(int k) const;
  // The network namespace's name (for `ip netns exec`).
  std::string netns(int k) const;
  // The prefix of every namespace of this run.
  const std::string& prefix() const { return prefix_; }
  // The set's name for deploy/emuhosts.sh --name ("zshosts-<pid>").
  std::string name() const;

  // Starts `binary` on host k (its network and a UTS namespace named
  // hostname(k)), output to `log_path`.
  std::unique_ptr<ChildProcess> Start(int k, const std::string& binary,
                                      const std::vector<std::string>& args,
                                      const std::string& log_path);
  // Runs a /bin/sh command line on host k and waits for it: (exit code,
  // combined output).
  std::pair<int, std::string> Run(int k, const std::string& command);

  // A firewall on host k: new TCP connections from other hosts are accepted
  // on ports first..last only (dropped silently otherwise, as a firewall
  // does); connections within the host pass.
  absl::Status AcceptTcpOnly(int k, int first, int last);

  // Limits host k's link to `bits_per_second` each way (0: no limit).
  absl::Status RateLimit(int k, int64_t bits_per_second);
  absl::Status CutOff(int k);
  absl::Status CutPair(int a, int b);
  absl::Status Heal(int k);
  absl::Status HealAll();

 private:
  EmulatedHosts(std::string prefix, int count) : prefix_(std::move(prefix)), count_(count) {}
  absl::Status Build();

  const std::string prefix_;
  const int count_;
  std::vector<int> netns_fds_;  // by host
};

}  // namespace zeroshard::testing

#endif  // ZEROSHARD_TESTS_TESTING_EMULATED_HOSTS_H_
