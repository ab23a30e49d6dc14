// hpZ (--secondary_shard_group_size): the backward's gathers read the
// secondary shards (copies of what the forward's gathers delivered) inside
// groups of H ranks. The copies are bit copies, so a run with hpZ computes
// on the same bits as the run without it: the checks below are bitwise
// against the same job without hpZ (which other tests hold to one process),
// and against one process within the error model of a change of summation
// order. A secondary copy left stale after a step, a resume or a recovery
// (DeepSpeed #7164, #7606) would feed the backward old parameters and break
// the bit equality from that step on. Real server and worker processes on
// loopback (one host: every group over shared memory); the bytes that cross
// hosts: tests/cluster:hpz_test and tests/bench/multihost_bench.
#include <algorithm>
#include <csignal>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/model_zoo.h"
#include "gtest/gtest.h"
#include "tests/testing/cluster.h"
#include "tests/testing/error_model.h"
#include "tests/testing/params.h"
#include "tests/testing/small_mlp.h"
#include "tests/testing/process.h"

namespace zeroshard {
namespace {

using testing::ExpectWithinBound;
using testing::LocalCluster;
using testing::MaxRelativeDifference;
using testing::Params;

// With prefetch 1 the last two forward units are kept for the backward, and
// the first layer's backward does not read its weight (its input needs no
// gradient): 5 layers leave layers 1 and 2 whose backward reads weights
// gathered from the secondary shards.
const testing::SmallMlp kMlp = [] {
  testing::SmallMlp mlp;  // 32 wide, GELU
  mlp.layers = 5;
  return mlp;
}();

int64_t Bytes(const nlohmann::json& report, const char* op) {
  return report["comm_bytes"][op].get<int64_t>();
}

class HpzTest : public ::testing::Test {
 protected:
  HpzTest() : cluster_(testing::MakeTempDir("hpz")) {}
  LocalCluster cluster_;
};

// W = 4, flat ZeRO-3, secondary groups of 2; and W = 8 in shard groups of 4
// (HSDP: two replicas) with secondary groups of 2 inside each group, as when
// the shard groups span two hosts. Each against the same job without hpZ,
// bit for bit, and against one process (8 rows a step) within the error
// model; the flat one also with packed collectives.
TEST_F(HpzTest, SecondaryShardsTrainTheMlpToTheSameBitsAsWithout) {
  ASSERT_TRUE(cluster_.ok());
  constexpr int kSteps = 5;
  ASSERT_TRUE(cluster_.Run("single", 1, kMlp.Flags(kSteps, {"--batch=8"})));
  const Params reference = kMlp.Load(cluster_.checkpoint_root(), "single", kSteps);
  struct Layout {
    std::string name;
    int world;
    std::vector<std::string> flags;
  };
  for (const Layout& layout : {Layout{"flat", 4, {"--batch=2"}},
                               Layout{"hsdp", 8, {"--batch=1", "--shard_group_size=4"}}}) {
    std::vector<std::string> flags = layout.flags;
    ASSERT_TRUE(cluster_.Run(layout.name, layout.world, kMlp.Flags(kSteps, flags)));
    flags.push_back("--secondary_shard_group_size=2");
    const std::string job = layout.name + "-hpz";
    ASSERT_TRUE(cluster_.Run(job, layout.world, kMlp.Flags(kSteps, flags)));
    const Params hpz = kMlp.Load(cluster_.checkpoint_root(), job, kSteps);
    ASSERT_EQ(hpz.size(), reference.size());
    EXPECT_EQ(hpz, kMlp.Load(cluster_.checkpoint_root(), layout.name, kSteps)) << layout.name;
    ExpectWithinBound(MaxRelativeDifference(hpz, reference), kMlp.Bound(kSteps, 8, reference),
                      absl::StrCat(job, " against one process"));
    // The backward gathered from the secondary shards: their bytes show,
    // and the primary gathers sent fewer bytes than the run without hpZ.
    for (int rank = 0; rank < layout.world; ++rank) {
      const nlohmann::json with = cluster_.Report(job, rank);
      const nlohmann::json without = cluster_.Report(layout.name, rank);
      const int64_t secondary = Bytes(with, "secondary_all_gather");
      EXPECT_GT(secondary, 0) << job << " rank " << rank;
      EXPECT_LT(Bytes(with, "all_gather") - secondary, Bytes(without, "all_gather"))
          << job << " rank " << rank;
      EXPECT_GT(with["memory"]["params_secondary"].get<int64_t>(), 0) << job;
    }
  }
  // The device path's packed collectives (one plain all-gather straight
  // into the unit from the secondary shards): the same bits again.
  ASSERT_TRUE(cluster_.Run("flat-hpz-packed", 4,
                           kMlp.Flags(kSteps, {"--batch=2", "--secondary_shard_group_size=2",
                                               "--packed_collectives=on"})));
  EXPECT_EQ(kMlp.Load(cluster_.checkpoint_root(), "flat-hpz-packed", kSteps),
            kMlp.Load(cluster_.checkpoint_root(), "flat-hpz", kSteps));
  EXPECT_GT(Bytes(cluster_.Report("flat-hpz-packed", 0), "secondary_all_gather"), 0);
  // Secondary groups of 2 hold half the model each, f32, plus the even
  // split's rounding (under 2 elements per unit).
  const nlohmann::json report = cluster_.Report("flat-hpz", 0);
  const int64_t parameters = report["parameters"];
  const int64_t secondary = report["memory"]["params_secondary"];
  EXPECT_GE(secondary, 4 * (parameters / 2));
  EXPECT_LE(secondary, 4 * (parameters / 2 + 2 * kMlp.layers));
  EXPECT_NE(cluster_.WorkerLog(0).find("data plane (secondary)"), std::string::npos);
}

// The GPT (attention, LayerNorm, GELU, a tied head) at W = 4 with secondary
// groups of 2 against one process with all four sequences: hsdp_test's
// bound for the same model (per block 6 chained sums plus the head; the
// longest sum is the MLP's 4 * d_model inner dimension).
TEST_F(HpzTest, SecondaryShardsTrainTheGptToOneProcesssParameters) {
  ASSERT_TRUE(cluster_.ok());
  constexpr int kSteps = 4;
  constexpr double kGptLr = 3e-3;
  std::vector<std::string> gpt = {
      "--model=gpt",  "--layers=2", "--heads=2",           "--d_model=32",
      "--context=16", "--steps=4",  "--lr=3e-3",           "--seed=5",
      "--stage=3",    "--checkpoint_at_end", "--collective_timeout=30s"};
  auto with = [&](std::vector<std::string> extra) {
    std::vector<std::string> flags = gpt;
    flags.insert(flags.end(), extra.begin(), extra.end());
    return flags;
  };
  ASSERT_TRUE(cluster_.Run("gpt-single", 1, with({"--batch=4"})));
  ASSERT_TRUE(
      cluster_.Run("gpt-hpz", 4, with({"--batch=1", "--secondary_shard_group_size=2"})));
  auto spec = Gpt2Spec(2, 32, 2, 256, 16);
  ASSERT_TRUE(spec.ok());
  const Params reference =
      testing::LoadCheckpointParams(cluster_.checkpoint_root(), "gpt-single", kSteps, *spec);
  const Params hpz =
      testing::LoadCheckpointParams(cluster_.checkpoint_root(), "gpt-hpz", kSteps, *spec);
  ASSERT_EQ(hpz.size(), spec->tensors.size());
  testing::TrainingErrorModel m;
  m.layers = 2 * 6 + 1;
  m.sum_length = 4 * 32;
  m.steps = kSteps;
  m.lr = kGptLr;
  m.param_scale = testing::SmallestTensorScale(reference);
  ExpectWithinBound(MaxRelativeDifference(hpz, reference), testing::AdamRelativeParamBound(m),
                    "GPT, W=4 with secondary groups of 2, against one process");
  EXPECT_GT(Bytes(cluster_.Report("gpt-hpz", 0), "secondary_all_gather"), 0);
}

// A job with hpZ checkpoints at step 3 and resumes at the same layout: the
// secondary shards are rebuilt from the loaded parameters, so steps 4-6
// equal the uninterrupted job's bit for bit. The same checkpoint,
// consolidated, continues at W = 2 in groups of 1 (no hpZ: no secondary
// group is smaller than a group of one), within the error model of one
// process.
TEST_F(HpzTest, CheckpointsResumeAndConsolidateAtAnotherWorldAndGroupSize) {
  ASSERT_TRUE(cluster_.ok());
  const std::vector<std::string> hpz = {"--batch=3", "--secondary_shard_group_size=2"};
  ASSERT_TRUE(cluster_.Run("uninterrupted", 4, kMlp.Flags(6, hpz)));
  ASSERT_TRUE(cluster_.Run("resumed", 4, kMlp.Flags(3, hpz)));
  const std::string consolidated = cluster_.dir() + "/hpz.safetensors";
  auto [code, output] = testing::RunCommand(
      absl::StrCat(testing::RunfilePath("client/shardctl"), " --server=", cluster_.address(),
                   " consolidate --job=resumed --step=latest --out=", consolidated));
  ASSERT_EQ(code, 0) << output;
  std::vector<std::string> resume = hpz;
  resume.push_back("--resume=latest");
  ASSERT_TRUE(cluster_.Run("resumed", 4, kMlp.Flags(6, resume)));
  EXPECT_EQ(kMlp.Load(cluster_.checkpoint_root(), "resumed", 6), kMlp.Load(cluster_.checkpoint_root(), "uninterrupted", 6));
  ASSERT_TRUE(cluster_.Run("single", 1, kMlp.Flags(6, {"--batch=12"})));
  ASSERT_TRUE(cluster_.Run(
      "from-file", 2,
      kMlp.Flags(6, {"--batch=6", "--shard_group_size=1", "--init_from=" + consolidated})));
  const Params reference = kMlp.Load(cluster_.checkpoint_root(), "single", 6);
  ExpectWithinBound(MaxRelativeDifference(kMlp.Load(cluster_.checkpoint_root(), "from-file", 6), reference),
                    kMlp.Bound(6, 12, reference), "hpZ W=4 H=2, consolidated, continued at W=2 G=1");
}

// A rank killed mid-run and replaced (DeepSpeed's hpZ gave wrong losses
// after such restarts): the next generation's engine starts with every
// slice stale, the snapshot's state is loaded (Initialize marks them stale
// too) and the first forward rebuilds them, so the run ends bit-equal to the
// uninterrupted one.
TEST(HpzRecoveryTest, AReplacedRankRebuildsTheSecondaryShardsAfterARecovery) {
  LocalCluster cluster(testing::MakeTempDir("hpz-recovery"),
                       {"--heartbeat_interval_ms=300", "--heartbeat_timeout_ms=1500"});
  ASSERT_TRUE(cluster.ok());
  constexpr int kSteps = 40;
  const std::vector<std::string> flags =
      kMlp.Flags(kSteps, {"--batch=2", "--secondary_shard_group_size=2", "--snapshot_every=10",
                        "--test_step_delay_ms=50", "--rejoin_timeout=60s", "--join_timeout_s=60"});
  ASSERT_TRUE(cluster.Run("reference", 4, flags));
  cluster.StartWorkers("replace", 4, flags);
  ASSERT_TRUE(testing::WaitFor(
      [&] { return cluster.WorkerLog(0).find("step 15/") != std::string::npos; },
      absl::Seconds(60)))
      << cluster.WorkerLog(0);
  cluster.worker(2)->Signal(SIGKILL);
  cluster.RestartWorker(2);
  const std::vector<int> codes = cluster.WaitWorkers(absl::Seconds(120));
  for (size_t r = 0; r < codes.size(); ++r) ASSERT_EQ(codes[r], 0) << cluster.WorkerLog(r);
  const nlohmann::json report = cluster.Report("replace", 0);
  ASSERT_GE(report["recoveries"].size(), 1u) << report.dump();
  EXPECT_EQ(report["recoveries"][0]["source"], "snapshot");
  EXPECT_EQ(kMlp.Load(cluster.checkpoint_root(), "replace", kSteps), kMlp.Load(cluster.checkpoint_root(), "reference", kSteps));
}

// H must divide W and be smaller than the shard groups; the job says so.
TEST_F(HpzTest, SecondaryGroupsAsLargeAsTheShardGroupsAreRefused) {
  ASSERT_TRUE(cluster_.ok());
  EXPECT_FALSE(cluster_.Run("refused", 2, kMlp.Flags(1, {"--secondary_shard_group_size=2"})));
  const std::string log = cluster_.WorkerLog(0);
  EXPECT_NE(log.find("must divide the world size 2 and be smaller than the shard groups of 2"),
            std::string::npos)
      << log;
}

}  // namespace
}  // namespace zeroshard
