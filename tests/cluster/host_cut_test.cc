// A worker host cut off from everything (the server and its peers), W = 4 as
// 2 hosts x 2 ranks. The server declares its ranks dead and host 1's ranks
// wait for them to re-join; the cut-off ranks' collectives time out, they see
// that the server does not answer either, and keep trying to re-join within
// --rejoin_timeout, saying so every few seconds. A cut that heals in time
// heals: the job continues with every rank from the in-memory snapshot, and
// ends bitwise equal to an uninterrupted run. A cut that does not ends with a
// message saying what could not be reached and for how long.
#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "tests/cluster/across_hosts.h"

namespace zeroshard::testing {
namespace {

using HostCutTest = AcrossHostsTest;

constexpr int kSteps = 100;

TEST_F(HostCutTest, AHostCutOffForTwentySecondsRejoinsAndTheJobKeepsEveryRank) {
  ASSERT_TRUE(StartCluster());
  const Params reference = Reference(kSteps);
  ASSERT_FALSE(reference.empty());
  cluster_->StartWorkers("host-cut", 4, Flags(Recoverable(kSteps, {})));
  ASSERT_TRUE(WaitForStep(25));
  ASSERT_TRUE(hosts_->CutOff(2).ok());
  absl::SleepFor(absl::Seconds(20));  // the cut is the scenario
  ASSERT_TRUE(hosts_->HealAll().ok());
  EXPECT_TRUE(AllExitZero(absl::Seconds(120)));
  for (int r : {2, 3}) {
    const std::string log = cluster_->WorkerLog(r);
    EXPECT_NE(log.find("has not answered a heartbeat"), std::string::npos) << log;
    EXPECT_NE(log.find("has not accepted it"), std::string::npos)
        << "no periodic message while re-joining:\n"
        << log;
  }
  const std::string w0 = cluster_->WorkerLog(0);
  EXPECT_NE(w0.find("at world size 4"), std::string::npos) << w0;
  ExpectEqual(Final("host-cut", kSteps), reference, "host cut off for 20 s, healed");
}

TEST_F(HostCutTest, AHostCutOffForGoodSaysWhatItCouldNotReach) {
  ASSERT_TRUE(StartCluster());
  cluster_->StartWorkers("cut-for-good", 4,
                         Flags(Recoverable(kSteps, {"--rejoin_timeout=15s", "--rejoin_grace=1s"})));
  ASSERT_TRUE(WaitForStep(25));
  ASSERT_TRUE(hosts_->CutOff(2).ok());
  const std::vector<int> codes = cluster_->WaitWorkers(absl::Seconds(90));
  for (int r : {2, 3}) {
    const std::string log = cluster_->WorkerLog(r);
    EXPECT_NE(codes[r], 0) << log;
    EXPECT_NE(codes[r], -1) << "still running:\n" << log;
    EXPECT_NE(log.find("recovery: re-join: UNAVAILABLE: "), std::string::npos) << log;
    EXPECT_NE(log.find(absl::StrCat("join of job 'cut-for-good' as 'w", r, "' at ",
                                    hosts_->address(kServerHost))),
              std::string::npos)
        << log;
    EXPECT_NE(log.find("tried for"), std::string::npos) << log;
  }
}

}  // namespace
}  // namespace zeroshard::testing
