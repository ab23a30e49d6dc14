// Silent data corruption between HSDP replicas (issue #43): W = 4 in shard
// groups of 2 (ranks 1 and 3 hold the same shard), real processes.
// --testing_corrupt=1:12 flips one exponent bit of rank 1's master shard
// after step 12; --replica_check_every=5 finds it at step 15 and every rank
// stops naming ranks 1 and 3. Without the corruption the check changes
// nothing: the parameters equal a run without it, bit for bit.
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/model_zoo.h"
#include "gtest/gtest.h"
#include "tests/testing/cluster.h"
#include "tests/testing/params.h"

namespace zeroshard {
namespace {

using testing::LocalCluster;

constexpr int kWorld = 4;
constexpr int kSteps = 20;

std::vector<std::string> Flags(std::vector<std::string> extra) {
  std::vector<std::string> flags = {"--model=mlp",         "--layers=2",
                                    "--width=16",          "--activation=gelu",
                                    "--batch=4",           absl::StrCat("--steps=", kSteps),
                                    "--stage=3",           "--shard_group_size=2",
                                    "--lr=0.01",           "--seed=3",
                                    "--checkpoint_at_end", "--collective_timeout=30s"};
  flags.insert(flags.end(), extra.begin(), extra.end());
  return flags;
}

TEST(ReplicaCheckTest, ACorruptedReplicaIsFoundAtTheNextCheckNamingItsRank) {
  LocalCluster cluster(testing::MakeTempDir("replica_check"));
  ASSERT_TRUE(cluster.ok());
  cluster.StartWorkers("corrupt", kWorld,
                       Flags({"--replica_check_every=5", "--testing_corrupt=1:12"}));
  const std::vector<int> codes = cluster.WaitWorkers(absl::Seconds(120));
  for (int rank = 0; rank < kWorld; ++rank) {
    const std::string log = cluster.WorkerLog(rank);
    EXPECT_EQ(codes[rank], 1) << log;
    EXPECT_NE(log.find("after step 15/20: the replicas of shard member 1 differ (rank 1 (host "),
              std::string::npos)
        << log;
    EXPECT_NE(log.find("rank 3 (host "), std::string::npos) << log;
  }
  const std::string log0 = cluster.WorkerLog(0);
  EXPECT_NE(log0.find("step 15/20  loss"), std::string::npos) << log0;
  EXPECT_EQ(log0.find("step 16/20  loss"), std::string::npos) << log0;
}

TEST(ReplicaCheckTest, TheCheckChangesNothing) {
  LocalCluster cluster(testing::MakeTempDir("replica_check"));
  ASSERT_TRUE(cluster.ok());
  ASSERT_TRUE(cluster.Run("checked", kWorld, Flags({"--replica_check_every=1"})));
  ASSERT_TRUE(cluster.Run("plain", kWorld, Flags({})));
  const absl::StatusOr<ModelSpec> spec = MlpSpec(2, 16, "gelu");
  ASSERT_TRUE(spec.ok());
  const testing::Params checked =
      testing::LoadCheckpointParams(cluster.checkpoint_root(), "checked", kSteps, *spec);
  ASSERT_FALSE(checked.empty());
  EXPECT_EQ(checked,
            testing::LoadCheckpointParams(cluster.checkpoint_root(), "plain", kSteps, *spec));
}

}  // namespace
}  // namespace zeroshard
