// The emulated hosts themselves: names and addresses of their own, reachable
// from each other and from nowhere else, silent cuts of a host and of a pair
// that heal, a rate limit that holds, and nothing left behind.
#include "tests/testing/emulated_hosts.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <memory>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "gtest/gtest.h"
#include "tests/testing/process.h"

namespace zeroshard::testing {
namespace {

constexpr int kPort = 9000;

std::unique_ptr<EmulatedHosts> MakeHosts(int count) {
  absl::StatusOr<std::unique_ptr<EmulatedHosts>> hosts = EmulatedHosts::Create(count);
  // Never a silent skip: CI runs as root and must run these tests.
  EXPECT_TRUE(hosts.ok()) << hosts.status();
  return hosts.ok() ? *std::move(hosts) : nullptr;
}

std::string Probe() { return "/usr/bin/python3 " + RunfilePath("tests/cluster/net_probe.py"); }

// "ok", "timeout" or "error <errno name>": what host `from` sees connecting
// to the probe server on host `to`.
std::string Connect(EmulatedHosts& hosts, int from, int to, double seconds = 1.5) {
  auto [code, output] = hosts.Run(
      from, absl::StrCat(Probe(), " connect ", hosts.address(to), " ", kPort, " ", seconds));
  return std::string(absl::StripAsciiWhitespace(output));
}

// Starts the probe server on host k and waits until it answers there.
std::unique_ptr<ChildProcess> Serve(EmulatedHosts& hosts, int k) {
  auto server =
      hosts.Start(k, "/usr/bin/python3",
                  {RunfilePath("tests/cluster/net_probe.py"), "serve", absl::StrCat(kPort)},
                  MakeTempDir("probe") + "/serve.log");
  EXPECT_TRUE(WaitFor([&] { return Connect(hosts, k, k) == "ok"; }, absl::Seconds(10)))
      << server->Log();
  return server;
}

TEST(EmulatedHostsTest, EachHostHasItsOwnNameAndAddress) {
  auto hosts = MakeHosts(2);
  ASSERT_NE(hosts, nullptr);
  for (int k = 0; k < 2; ++k) {
    auto [code, output] = hosts->Run(k, "hostname; ip -4 -o addr show dev eth0");
    EXPECT_EQ(code, 0) << output;
    EXPECT_NE(output.find(hosts->hostname(k) + "\n"), std::string::npos) << output;
    EXPECT_NE(output.find(hosts->address(k) + "/24"), std::string::npos) << output;
  }
  // The test-only range exists only inside the hosts.
  auto [code, root] = RunCommand("ip -4 -o addr show");
  EXPECT_EQ(root.find("198.18."), std::string::npos) << root;
}

TEST(EmulatedHostsTest, AProcessStartedOnAHostSeesItsNameAndNetwork) {
  auto hosts = MakeHosts(2);
  ASSERT_NE(hosts, nullptr);
  const std::string log = MakeTempDir("start") + "/out.log";
  auto child = hosts->Start(1, "/bin/sh", {"-c", "hostname; ip -4 -o addr show dev eth0"}, log);
  ASSERT_EQ(child->Wait(absl::Seconds(10)), 0) << child->Log();
  EXPECT_NE(child->Log().find("host1\n"), std::string::npos) << child->Log();
  EXPECT_NE(child->Log().find(hosts->address(1) + "/24"), std::string::npos) << child->Log();
}

TEST(EmulatedHostsTest, ACutOffHostIsSilentBothWaysUntilHealed) {
  auto hosts = MakeHosts(3);
  ASSERT_NE(hosts, nullptr);
  auto on1 = Serve(*hosts, 1);
  auto on2 = Serve(*hosts, 2);
  EXPECT_EQ(Connect(*hosts, 2, 1), "ok");
  ASSERT_TRUE(hosts->CutOff(1).ok());
  // No RST, no ICMP, and no EPERM on the cut host's own side either.
  EXPECT_EQ(Connect(*hosts, 2, 1), "timeout");
  EXPECT_EQ(Connect(*hosts, 1, 2), "timeout");
  EXPECT_EQ(Connect(*hosts, 0, 1), "timeout");
  EXPECT_EQ(Connect(*hosts, 1, 1), "ok") << "a host still reaches itself";
  EXPECT_EQ(Connect(*hosts, 0, 2), "ok") << "the others still reach each other";
  ASSERT_TRUE(hosts->Heal(1).ok());
  EXPECT_EQ(Connect(*hosts, 2, 1), "ok");
  EXPECT_EQ(Connect(*hosts, 1, 2), "ok");
}

TEST(EmulatedHostsTest, ACutPairPartitionsThatPairOnly) {
  auto hosts = MakeHosts(3);
  ASSERT_NE(hosts, nullptr);
  auto on0 = Serve(*hosts, 0);
  auto on1 = Serve(*hosts, 1);
  ASSERT_TRUE(hosts->CutPair(0, 2).ok());
  EXPECT_EQ(Connect(*hosts, 2, 0), "timeout");
  EXPECT_EQ(Connect(*hosts, 1, 0), "ok");
  EXPECT_EQ(Connect(*hosts, 2, 1), "ok");
  ASSERT_TRUE(hosts->HealAll().ok());
  EXPECT_EQ(Connect(*hosts, 2, 0), "ok");
}

TEST(EmulatedHostsTest, ARateLimitBoundsWhatCrossesTheLink) {
  auto hosts = MakeHosts(2);
  ASSERT_NE(hosts, nullptr);
  auto on1 = Serve(*hosts, 1);
  constexpr int64_t kRate = 4'000'000;  // bits/s
  constexpr int64_t kBytes = 1 << 19;
  ASSERT_TRUE(hosts->RateLimit(1, kRate).ok());
  auto [code, output] =
      hosts->Run(0, absl::StrCat(Probe(), " send ", hosts->address(1), " ", kPort, " ", kBytes));
  ASSERT_EQ(code, 0) << output;
  double seconds = 0;
  ASSERT_TRUE(absl::SimpleAtod(absl::StripAsciiWhitespace(output), &seconds)) << output;
  // A lower bound only (a link cannot beat its limit; a slow machine may be
  // slower): the payload less the two buckets' bursts (16 KiB each) at the
  // rate. The TCP/IP headers the limit also counts only make it slower.
  const double floor_s = (kBytes - 2 * 16384) * 8.0 / kRate;
  EXPECT_GE(seconds, floor_s) << "sent " << kBytes << " bytes in " << seconds << " s";
  std::fprintf(stderr, "%lld bytes at %lld bit/s: %.2f s (at least %.2f s)\n",
               static_cast<long long>(kBytes), static_cast<long long>(kRate), seconds, floor_s);
  ASSERT_TRUE(hosts->RateLimit(1, 0).ok());
}

TEST(EmulatedHostsTest, TeardownLeavesNothingAndStaleRunsAreSwept) {
  // A namespace of a run whose process is gone (a crashed test).
  pid_t gone = fork();
  if (gone == 0) _exit(0);
  waitpid(gone, nullptr, 0);
  const std::string stale = absl::StrCat("zshosts-", gone, "-h0");
  ASSERT_EQ(RunCommand("ip netns add " + stale).first, 0);
  std::string prefix;
  {
    auto hosts = MakeHosts(2);
    ASSERT_NE(hosts, nullptr);
    prefix = hosts->prefix();
    EXPECT_EQ(RunCommand("ip netns list").second.find(stale), std::string::npos)
        << "the stale namespace was not swept";
    EXPECT_NE(RunCommand("ip netns list").second.find(prefix), std::string::npos);
  }
  EXPECT_EQ(RunCommand("ip netns list").second.find(prefix), std::string::npos)
      << RunCommand("ip netns list").second;
}

}  // namespace
}  // namespace zeroshard::testing
