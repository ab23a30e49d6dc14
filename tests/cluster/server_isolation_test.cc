// The server's own host cut off silently while training goes on (W = 4 as 2
// hosts x 2 ranks, the server on a third host): nobody is declared dead (the
// server suspects its own network, failure_detector.h rule 4), heartbeats
// resume within 2 s of the network's return (gRPC keepalive and a capped
// reconnect backoff, common/keepalive.h), every worker exits 0 and the final
// parameters equal an uninterrupted run's.
#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "tests/cluster/across_hosts.h"

namespace zeroshard::testing {
namespace {

class ServerIsolationTest : public AcrossHostsTest, public ::testing::WithParamInterface<int> {};

TEST_P(ServerIsolationTest, NoGenerationChangeAndHeartbeatsBackWithinTwoSeconds) {
  const absl::Duration cut = absl::Seconds(GetParam());
  ASSERT_TRUE(StartCluster());
  // Long enough to train through the cut and >= 10 s past the heal (steps
  // take >= 200 ms: --test_step_delay_ms), so every worker is still there to
  // beat again when the network is back.
  const int steps = static_cast<int>(absl::ToInt64Seconds(cut + absl::Seconds(12))) * 5;
  const Params reference = Reference(steps);
  ASSERT_FALSE(reference.empty());

  cluster_->StartWorkers("isolated", 4,
                         Flags({absl::StrCat("--steps=", steps), "--test_step_delay_ms=200"}));
  ASSERT_TRUE(WaitForStep(10));
  ASSERT_TRUE(hosts_->CutOff(kServerHost).ok());
  const absl::Time cut_at = absl::Now();
  const int step_at_cut = LatestStep();
  // The cut is the scenario, not a wait for a condition.
  absl::SleepFor(cut);
  const int step_at_heal = LatestStep();
  ASSERT_TRUE(hosts_->HealAll().ok());
  const absl::Time healed = absl::Now();
  std::fprintf(stderr, "cut %s: rank 0 trained steps %d..%d meanwhile\n",
               absl::FormatDuration(cut).c_str(), step_at_cut, step_at_heal);
  EXPECT_GT(step_at_heal, step_at_cut) << "training did not go on during the server's cut";

  // Every member's first beat after the network came back.
  std::map<std::string, absl::Time> resumed;
  ASSERT_TRUE(WaitFor(
      [&] {
        resumed = ServerEvents("heartbeat_resumed", cut_at);
        return resumed.size() == 4;
      },
      absl::Seconds(30)))
      << resumed.size() << " of 4 members beat again:\n"
      << cluster_->server()->Log();
  for (const auto& [worker, at] : resumed) {
    const double after_s = absl::ToDoubleSeconds(at - healed);
    std::fprintf(stderr, "%s: heartbeats back %.2f s after the network\n", worker.c_str(), after_s);
    // Nominally <= 1.3 s (the channel's reconnect backoff, at most 1 s, and
    // a 300-ms beat); 5 s leaves room for a loaded 2-core machine.
    EXPECT_LE(after_s, 5.0) << worker;
  }
  EXPECT_TRUE(AllExitZero(absl::Seconds(120)));
  const std::string server_log = cluster_->server()->Log();
  EXPECT_EQ(server_log.find("event=generation_bumped"), std::string::npos) << server_log;
  EXPECT_EQ(server_log.find("event=member_dead"), std::string::npos) << server_log;
  EXPECT_NE(server_log.find("event=isolation_suspected"), std::string::npos) << server_log;
  ExpectEqual(Final("isolated", steps), reference, "server host cut");
}

// 20 s (the cut that forced a recovery before), and 60 s (the one whose
// heartbeats came back 52-56 s after the network).
INSTANTIATE_TEST_SUITE_P(Cuts, ServerIsolationTest, ::testing::Values(20, 60),
                         [](const auto& info) { return absl::StrCat(info.param, "s"); });

}  // namespace
}  // namespace zeroshard::testing
