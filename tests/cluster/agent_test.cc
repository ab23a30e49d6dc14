// A real job through node agents: W = 4 as 2 hosts x 2 ranks, one shard_agent
// per worker host, every worker with --agent. The recoveries that direct
// streams go through go the same way through agents: a rank killed (the
// launcher restarts it; its agent reports the death at once) and a worker
// host cut off silently and healed (its agent goes silent with it; its ranks
// are declared dead by the timeout), then a rank and its buddy killed at once
// (two agents report a death each; the snapshot is lost with the buddy, so
// the job falls back to its disk checkpoint). The job keeps W = 4, so its
// final parameters equal the uninterrupted run's (direct streams) bitwise.
#include <signal.h>

#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "tests/cluster/across_hosts.h"
#include "tests/testing/process.h"

namespace zeroshard::testing {
namespace {

using AgentTest = AcrossHostsTest;

constexpr int kSteps = 120;

TEST_F(AgentTest, KilledRanksAndACutHostRecoverThroughAgentsAsThroughDirectStreams) {
  ASSERT_TRUE(StartCluster());
  const Params reference = Reference(kSteps);  // direct streams, uninterrupted
  ASSERT_FALSE(reference.empty());
  cluster_->UseAgents();  // a shard_agent on each worker host; each worker --agent
  cluster_->StartWorkers(
      "via-agents", 4,
      Flags(Recoverable(kSteps, {"--collective_timeout=4s", "--checkpoint_every=20"})));
  ASSERT_NE(cluster_->agent(1), nullptr);
  ASSERT_NE(cluster_->agent(2), nullptr);

  // A rank killed: its agent reports its stream closed, the server declares
  // it dead, the launcher's restart joins through the agent.
  ASSERT_TRUE(WaitForStep(15)) << cluster_->WorkerLog(0);
  const absl::Time killed = absl::Now();
  cluster_->worker(1)->Signal(SIGKILL);
  cluster_->RestartWorker(1);
  ASSERT_TRUE(WaitFor([&] { return ServerEvents("member_dead", killed).count("w1") == 1; },
                      absl::Seconds(30)))
      << cluster_->server()->Log();
  std::fprintf(stderr, "rank 1 killed: declared dead %.1f s later\n",
               absl::ToDoubleSeconds(ServerEvents("member_dead", killed)["w1"] - killed));
  const int resume_from = LatestStep();
  ASSERT_TRUE(WaitForStep(resume_from + 3)) << cluster_->WorkerLog(0);

  // Host 2 cut off (its agent and ranks silent) until the server declared
  // its ranks dead, then healed.
  ASSERT_LT(LatestStep(), kSteps - 70) << "the faults ran into the end of training";
  const absl::Time cut = absl::Now();
  ASSERT_TRUE(hosts_->CutOff(2).ok());
  const bool detected = WaitFor(
      [&] {
        std::map<std::string, absl::Time> dead = ServerEvents("member_dead", cut);
        return dead.count("w2") == 1 && dead.count("w3") == 1;
      },
      absl::Seconds(20));
  ASSERT_TRUE(hosts_->HealAll().ok());
  ASSERT_TRUE(detected) << cluster_->server()->Log();
  std::map<std::string, absl::Time> dead = ServerEvents("member_dead", cut);
  std::fprintf(stderr, "host 2 cut: w2, w3 declared dead %.1f s, %.1f s later\n",
               absl::ToDoubleSeconds(dead["w2"] - cut), absl::ToDoubleSeconds(dead["w3"] - cut));

  // Rank 1 and its buddy rank 3 (on the other host: shift 2) killed at once
  // after a disk checkpoint: rank 1's snapshot went with rank 3, so the job
  // restores the checkpoint (recovery_test's direct-stream case, via agents).
  ASSERT_TRUE(WaitForStep(LatestStep() + 3)) << cluster_->WorkerLog(0);
  const int checkpointed = (LatestStep() / 20 + 1) * 20;
  ASSERT_LT(checkpointed, kSteps - 15) << "the faults ran into the end of training";
  ASSERT_TRUE(WaitForStep(checkpointed + 2)) << cluster_->WorkerLog(0);
  const absl::Time pair_killed = absl::Now();
  cluster_->worker(1)->Signal(SIGKILL);
  cluster_->worker(3)->Signal(SIGKILL);
  cluster_->RestartWorker(1);
  cluster_->RestartWorker(3);
  // The kills reach the server through the agents. One death may be all
  // it sees: a restart that joins first bumps the generation, and the other
  // restart joins the new one without being declared dead.
  ASSERT_TRUE(WaitFor([&] { return !ServerEvents("member_dead", pair_killed).empty(); },
                      absl::Seconds(30)))
      << cluster_->server()->Log();

  EXPECT_TRUE(AllExitZero(absl::Seconds(90)));
  EXPECT_NE(cluster_->WorkerLog(0).find("from disk"), std::string::npos) << cluster_->WorkerLog(0);
  // Both agents held a stream to the server (and no worker went around its
  // agent: the cluster checks their logs when it goes).
  const std::string server_log = cluster_->server()->Log();
  for (const char* host : {"host1", "host2"}) {
    EXPECT_NE(server_log.find(absl::StrCat("event=agent_stream_opened node=\"", host, " ")),
              std::string::npos)
        << server_log;
  }
  ExpectEqual(Final("via-agents", kSteps), reference, "a killed rank and a cut host, via agents");
}

}  // namespace
}  // namespace zeroshard::testing
