// The long direct-stream recovery scenarios, through node agents (issue #31:
// "a real 4-rank job on emulated hosts through agents behaves like today's
// direct streams in every recovery test"): partition_test's host that loses
// only the server for 20 s, and server_isolation_test's server host cut off
// for 20 s, with the same expectations as there. ~1 minute each, so not in
// CI (tags = ["manual"]): bazel test //tests/cluster:agent_recovery_test.
// The scenarios short enough for CI are in agent_test.
//
// As of its first run (2026-11-26, a starved 2-core machine) the partition
// case fails: ~12 s into the cut the cut host's agent stream closes, and its
// ranks are declared dead and the generation bumped, where direct streams
// keep them (their peers vouch for them); docs/scale.md. The server-cut case
// passes.
#include <cstdio>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "tests/cluster/agent_hosts.h"
#include "tests/testing/process.h"

namespace zeroshard::testing {
namespace {

class AgentRecoveryTest : public AgentHostsTest {
 protected:
  static constexpr int kSteps = 160;  // >= 200 ms a step: the 20-s cut and >= 10 s more

  // Trains job `job` through agents with `cut` applied at step 10 for 20 s,
  // then healed; expects what the direct-stream test expects: training went
  // on during the cut, every worker in `beat_again` beat again, nobody was
  // declared dead, every worker exited 0 and the result is the uninterrupted
  // run's.
  void TrainThroughATwentySecondCut(const std::string& job,
                                    const std::function<absl::Status()>& cut,
                                    const std::vector<std::string>& beat_again) {
    ASSERT_TRUE(StartCluster());
    const Params reference = Reference(kSteps);
    ASSERT_FALSE(reference.empty());
    ASSERT_TRUE(StartAgents());
    cluster_->StartWorkers(job, 4,
                           Flags({absl::StrCat("--steps=", kSteps), "--test_step_delay_ms=200"}),
                           AgentFlags());
    ASSERT_TRUE(WaitForStep(10));
    ASSERT_TRUE(cut().ok());
    const absl::Time cut_at = absl::Now();
    const int step_at_cut = LatestStep();
    absl::SleepFor(absl::Seconds(20));  // the cut is the scenario
    const int step_at_heal = LatestStep();
    ASSERT_TRUE(hosts_->HealAll().ok());
    const absl::Time healed = absl::Now();
    std::fprintf(stderr, "%s via agents: rank 0 trained steps %d..%d meanwhile\n", job.c_str(),
                 step_at_cut, step_at_heal);
    EXPECT_GT(step_at_heal, step_at_cut);
    std::map<std::string, absl::Time> resumed;
    EXPECT_TRUE(WaitFor(
        [&] {
          resumed = ServerEvents("heartbeat_resumed", cut_at);
          for (const std::string& worker : beat_again) {
            if (resumed.count(worker) == 0) return false;
          }
          return true;
        },
        absl::Seconds(30)))
        << cluster_->server()->Log();
    for (const auto& [worker, at] : resumed) {
      std::fprintf(stderr, "%s: heartbeats back %.2f s after the network\n", worker.c_str(),
                   absl::ToDoubleSeconds(at - healed));
    }
    EXPECT_TRUE(AllExitZero(absl::Seconds(120)));
    const std::string server_log = cluster_->server()->Log();
    EXPECT_EQ(server_log.find("event=member_dead"), std::string::npos) << server_log;
    EXPECT_EQ(server_log.find("event=generation_bumped"), std::string::npos) << server_log;
    ExpectEveryRankWentThroughItsAgent();
    ExpectEqual(Final(job, kSteps), reference, job + " for 20 s, via agents");
  }
};

// partition_test's first case.
TEST_F(AgentRecoveryTest, AHostThatLosesOnlyTheServerForTwentySecondsKeepsItsRanks) {
  TrainThroughATwentySecondCut(
      "partition", [&] { return hosts_->CutPair(kServerHost, 2); }, {"w2", "w3"});
}

// server_isolation_test's 20-s case.
TEST_F(AgentRecoveryTest, TheServersHostCutOffForTwentySecondsChangesNoGeneration) {
  TrainThroughATwentySecondCut(
      "isolated", [&] { return hosts_->CutOff(kServerHost); }, {"w0", "w1", "w2", "w3"});
}

}  // namespace
}  // namespace zeroshard::testing
