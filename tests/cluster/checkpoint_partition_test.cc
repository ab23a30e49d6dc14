// A partition spanning checkpoints (#51): host 2 (w2, w3) loses the server
// for 20 s while the job checkpoints every 20 steps. (Not also through node
// agents, as partition_test is: the checkpointer is the workers', the same
// either way.)
#include <cstdio>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "tests/cluster/across_hosts.h"
#include "tests/testing/process.h"

namespace zeroshard::testing {
namespace {

using CheckpointPartitionTest = AcrossHostsTest;

// The same partition with a checkpoint every 20 steps (~4 s): the cut-off
// host's commits wait for the server while its ranks train on (the
// checkpointer keeps the written shards and commits them in order once the
// server answers), so no rank stalls, no generation changes, and afterwards
// every checkpoint step is complete: a manifest per step, the final one
// equal to the uninterrupted run's. (Before, the next checkpoint waited for
// the previous commit: the cut-off ranks stalled the data plane, and they
// were declared dead, #51.)
TEST_F(CheckpointPartitionTest, CheckpointsInsideThePartitionAreCommittedAfterItAndNobodyWaits) {
  ASSERT_TRUE(StartCluster());
  const int steps = 160;
  const int every = 20;
  const Params reference = Reference(steps);
  ASSERT_FALSE(reference.empty());
  cluster_->StartWorkers("ckpt-partition", 4,
                         Flags({absl::StrCat("--steps=", steps), "--test_step_delay_ms=200",
                                absl::StrCat("--checkpoint_every=", every)}));
  ASSERT_TRUE(WaitForStep(10));
  ASSERT_TRUE(hosts_->CutPair(kServerHost, 2).ok());
  const int step_at_cut = LatestStep();
  absl::SleepFor(absl::Seconds(20));  // the partition is the scenario
  const int step_at_heal = LatestStep();
  ASSERT_TRUE(hosts_->HealAll().ok());
  std::fprintf(stderr, "partition: rank 0 trained steps %d..%d meanwhile\n", step_at_cut,
               step_at_heal);
  // At least two checkpoints fell inside the partition.
  EXPECT_GE(step_at_heal / every - step_at_cut / every, 2) << "the partition spanned too few";
  EXPECT_TRUE(AllExitZero(absl::Seconds(120)));
  const std::string server_log = cluster_->server()->Log();
  EXPECT_EQ(server_log.find("event=member_dead"), std::string::npos) << server_log;
  EXPECT_EQ(server_log.find("event=generation_bumped"), std::string::npos) << server_log;
  for (int step = every; step <= steps; step += every) {
    const std::string manifest = absl::StrCat(cluster_->checkpoint_root(), "/ckpt-partition/",
                                              "step-", step, "/manifest.json");
    EXPECT_FALSE(ReadFileOrEmpty(manifest).empty()) << "step " << step << " never committed";
  }
  ExpectEqual(Final("ckpt-partition", steps), reference, "checkpoints inside the partition");
}

}  // namespace
}  // namespace zeroshard::testing
