// The data plane across a firewall, W = 4 as 2 hosts x 2 ranks. Each worker
// host accepts new TCP connections from other hosts on 29500-29519 only
// (nftables; the server's host is open). With --data_plane_ports=29500-29519
// the job trains and ends bitwise equal to an uninterrupted run without the
// firewall; without it, the data plane's connects are dropped and every
// worker fails within the collective timeout, naming the peer's address.
#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "tests/cluster/across_hosts.h"

namespace zeroshard::testing {
namespace {

using DataPlaneTest = AcrossHostsTest;

constexpr int kSteps = 30;
constexpr int kFirst = 29500;
constexpr int kLast = 29519;

bool Firewall(EmulatedHosts& hosts) {
  for (int k : {1, 2}) {
    absl::Status s = hosts.AcceptTcpOnly(k, kFirst, kLast);
    if (!s.ok()) {
      ADD_FAILURE() << s;
      return false;
    }
  }
  return true;
}

TEST_F(DataPlaneTest, ThroughAFirewallThatOpensOnlyTheDataPlanePorts) {
  ASSERT_TRUE(StartCluster());
  const Params reference = Reference(kSteps);
  ASSERT_FALSE(reference.empty());
  ASSERT_TRUE(Firewall(*hosts_));
  cluster_->StartWorkers("ports", 4,
                         Flags({absl::StrCat("--steps=", kSteps),
                                absl::StrCat("--data_plane_ports=", kFirst, "-", kLast)}));
  ASSERT_TRUE(AllExitZero(absl::Seconds(120)));
  ExpectEqual(Final("ports", kSteps), reference, "through the firewall");
}

TEST_F(DataPlaneTest, ADroppedConnectFailsWithinTheCollectiveTimeoutNamingThePeer) {
  ASSERT_TRUE(StartCluster());
  ASSERT_TRUE(Firewall(*hosts_));
  const absl::Duration timeout = absl::Seconds(4);
  const absl::Time started = absl::Now();
  cluster_->StartWorkers(
      "dropped", 4,
      Flags({absl::StrCat("--steps=", kSteps),
             absl::StrCat("--collective_timeout=", absl::FormatDuration(timeout)),
             // A failed setup is otherwise joined again up to --max_recoveries
             // times (#29): this test is about one setup's failure.
             "--max_recoveries=0"}));
  // Gloo's own wait was 5 x the timeout (20 s here), TCP's retries ~2 min:
  // the deadline is the timeout plus the processes' start and join.
  const std::vector<int> codes = cluster_->WaitWorkers(timeout + absl::Seconds(14));
  std::fprintf(stderr, "workers ended %.1f s after they started (collective timeout %s)\n",
               absl::ToDoubleSeconds(absl::Now() - started), absl::FormatDuration(timeout).c_str());
  int named = 0;
  for (size_t r = 0; r < codes.size(); ++r) {
    const std::string log = cluster_->WorkerLog(r);
    EXPECT_NE(codes[r], 0) << log;
    EXPECT_NE(codes[r], -1) << "still running at the deadline:\n" << log;
    const bool says =
        log.find("no connection to the peer's data plane at [198.18.0.") != std::string::npos &&
        log.find("within 4s") != std::string::npos;
    if (says && named == 0) {
      const size_t at = log.rfind('\n', log.find("no connection to the peer's data plane"));
      const size_t end = log.find('\n', at + 1);
      std::fprintf(stderr, "worker %zu says: %s\n", r, log.substr(at + 1, end - at - 1).c_str());
    }
    named += says;
    if (!says) std::fprintf(stderr, "worker %zu:\n%s\n", r, log.c_str());
  }
  // The ranks that connect (the others wait to be connected to) name the peer.
  EXPECT_GE(named, 2);
}

}  // namespace
}  // namespace zeroshard::testing
