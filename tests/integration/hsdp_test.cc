// Hybrid sharding (--shard_group_size): W = 4 ranks as 2 shard groups of 2
// train to the parameters one process reaches on the global batch, within
// the error model of a change of summation order; a group of one is
// bitwise the flat run at W = 2; HSDP checkpoints consolidate and resume at
// another world size and group size. Real server and worker processes on
// loopback (one host: the groups' collectives run over shared memory, the
// replicas' over TCP).
#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/model_zoo.h"
#include "gtest/gtest.h"
#include "tests/testing/cluster.h"
#include "tests/testing/error_model.h"
#include "tests/testing/params.h"
#include "tests/testing/small_mlp.h"

namespace zeroshard {
namespace {

using testing::ExpectWithinBound;
using testing::LocalCluster;
using testing::MaxRelativeDifference;
using testing::Params;

const testing::SmallMlp kMlp;  // 3 x 32, GELU

class HsdpTest : public ::testing::Test {
 protected:
  HsdpTest() : cluster_(testing::MakeTempDir("hsdp")) {}
  LocalCluster cluster_;
};

TEST_F(HsdpTest, TwoGroupsOfTwoTrainTheMlpToOneProcesssParameters) {
  ASSERT_TRUE(cluster_.ok());
  constexpr int kSteps = 5;
  ASSERT_TRUE(cluster_.Run("single", 1, kMlp.Flags(kSteps, {"--stage=3", "--batch=8"})));
  const Params reference = kMlp.Load(cluster_.checkpoint_root(), "single", kSteps);
  for (int stage : {2, 3}) {
    const std::string job = absl::StrCat("hsdp-stage", stage);
    ASSERT_TRUE(cluster_.Run(
        job, 4,
        kMlp.Flags(kSteps, {absl::StrCat("--stage=", stage), "--batch=2", "--shard_group_size=2"})));
    ExpectWithinBound(MaxRelativeDifference(kMlp.Load(cluster_.checkpoint_root(), job, kSteps), reference),
                      kMlp.Bound(kSteps, 8, reference), absl::StrCat("HSDP stage ", stage));
    const std::string log = cluster_.WorkerLog(0);
    EXPECT_NE(log.find("data plane (replicas)"), std::string::npos) << log;
  }
  // Per-rank state is a 2-rank job's: 16 bytes (f32 master, gradient, two
  // Adam moments) per element of the rank's chunks, which hold half the
  // model (and the plan's padding: at most 63 elements per unit).
  const nlohmann::json report = cluster_.Report("hsdp-stage3", 1);
  const int64_t parameters = report["parameters"];
  const int64_t shard = report["shard_elements"];
  EXPECT_GE(shard, parameters / 2);
  EXPECT_LE(shard, parameters / 2 + kMlp.layers * 63);
  EXPECT_EQ(report["memory"]["model_state_bytes"].get<int64_t>(), 16 * shard);
}

// Groups of one rank: each rank holds the whole model and the replicas'
// all-reduce is the only reduction. At W = 2 it adds the same two numbers
// as the flat reduce-scatter (a + b == b + a) and every rank runs the same
// products: the same bits as the flat stage-3 run.
TEST_F(HsdpTest, GroupsOfOneAreBitwiseTheFlatRunForTheGpt) {
  ASSERT_TRUE(cluster_.ok());
  std::vector<std::string> gpt = {
      "--model=gpt",  "--layers=2", "--heads=2",           "--d_model=32",
      "--context=16", "--batch=4",  "--steps=4",           "--lr=3e-3",
      "--seed=5",     "--stage=3",  "--checkpoint_at_end", "--collective_timeout=30s"};
  ASSERT_TRUE(cluster_.Run("gpt-flat", 2, gpt));
  gpt.push_back("--shard_group_size=1");
  ASSERT_TRUE(cluster_.Run("gpt-hsdp", 2, gpt));
  auto spec = Gpt2Spec(2, 32, 2, 256, 16);
  ASSERT_TRUE(spec.ok());
  const Params flat =
      testing::LoadCheckpointParams(cluster_.checkpoint_root(), "gpt-flat", 4, *spec);
  const Params hsdp =
      testing::LoadCheckpointParams(cluster_.checkpoint_root(), "gpt-hsdp", 4, *spec);
  EXPECT_EQ(hsdp.size(), spec->tensors.size());
  EXPECT_EQ(hsdp, flat);
  const nlohmann::json report = cluster_.Report("gpt-hsdp", 0);
  EXPECT_LT(report["losses"].back().get<double>(), report["losses"].front().get<double>());
}

// The GPT (attention, LayerNorm, GELU, a tied head) at W = 4 as two groups
// of two, one sequence per rank, against one process with all four: the
// same samples (text_data.h's layout does not depend on W), summed in
// another order. The MLP's Adam bound with the GPT's depth: per block a
// forward + backward chains the QKV, attention scores, attention-weighted
// values, output projection and the two MLP GEMMs (6 sums), plus the head;
// the longest sum is the MLP's 4 * d_model inner dimension (128 > 64 tokens).
TEST_F(HsdpTest, TwoGroupsOfTwoTrainTheGptToOneProcesssParameters) {
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
  ASSERT_TRUE(cluster_.Run("gpt-groups", 4, with({"--batch=1", "--shard_group_size=2"})));
  auto spec = Gpt2Spec(2, 32, 2, 256, 16);
  ASSERT_TRUE(spec.ok());
  const Params reference =
      testing::LoadCheckpointParams(cluster_.checkpoint_root(), "gpt-single", kSteps, *spec);
  const Params groups =
      testing::LoadCheckpointParams(cluster_.checkpoint_root(), "gpt-groups", kSteps, *spec);
  ASSERT_EQ(groups.size(), spec->tensors.size());
  testing::TrainingErrorModel m;
  m.layers = 2 * 6 + 1;
  m.sum_length = 4 * 32;
  m.steps = kSteps;
  m.lr = kGptLr;
  m.param_scale = testing::SmallestTensorScale(reference);
  ExpectWithinBound(MaxRelativeDifference(groups, reference), testing::AdamRelativeParamBound(m),
                    "GPT, 2 groups of 2 against one process");
  EXPECT_NE(cluster_.WorkerLog(0).find("data plane (replicas)"), std::string::npos);
}

// --packed_collectives (the device path's gathers and reduce-scatters
// through packed buffers, engine_packed_test's PackedCollectivesGiveTheSameBits)
// through real workers on the CPU: two groups of two with bf16 parameters
// and reductions, accumulation, and secondary shards (hpZ) inside the
// groups; then the same with f32 at stage 2. Packed equals the block
// collectives bit for bit, checkpoints included.
TEST_F(HsdpTest, PackedCollectivesAreBitwiseTheBlockPath) {
  ASSERT_TRUE(cluster_.ok());
  constexpr int kSteps = 4;
  const std::vector<std::vector<std::string>> cases = {
      {"--stage=3", "--param_dtype=bf16", "--reduce_dtype=bf16", "--grad_accum=2",
       "--secondary_shard_group_size=1"},
      {"--stage=2"},
  };
  for (size_t c = 0; c < cases.size(); ++c) {
    Params runs[2];
    for (int packed : {0, 1}) {
      std::vector<std::string> flags = cases[c];
      flags.push_back("--batch=2");
      flags.push_back("--shard_group_size=2");
      flags.push_back(packed ? "--packed_collectives=on" : "--packed_collectives=off");
      const std::string job = absl::StrCat("packed", c, packed ? "-on" : "-off");
      ASSERT_TRUE(cluster_.Run(job, 4, kMlp.Flags(kSteps, flags)));
      runs[packed] = kMlp.Load(cluster_.checkpoint_root(), job, kSteps);
      const nlohmann::json report = cluster_.Report(job, 0);
      EXPECT_LT(report["losses"].back().get<double>(), report["losses"].front().get<double>())
          << job;
    }
    EXPECT_FALSE(runs[0].empty());
    EXPECT_EQ(runs[1], runs[0]) << absl::StrJoin(cases[c], " ");
  }
  EXPECT_FALSE(cluster_.Run("packed-bad", 1, kMlp.Flags(1, {"--packed_collectives=yes"})));
  const std::string log = cluster_.WorkerLog(0);
  EXPECT_NE(log.find("--packed_collectives=yes is not one of auto, on, off"), std::string::npos)
      << log;
}

TEST_F(HsdpTest, CheckpointsConsolidateAndResumeAtAnotherWorldAndGroupSize) {
  ASSERT_TRUE(cluster_.ok());
  // Global batch 12 rows at every world size: W × batch.
  ASSERT_TRUE(cluster_.Run("uninterrupted", 1, kMlp.Flags(6, {"--stage=3", "--batch=12"})));
  ASSERT_TRUE(
      cluster_.Run("resumed", 4, kMlp.Flags(3, {"--stage=3", "--batch=3", "--shard_group_size=2"})));
  // The server accepted every rank's piece and merges them.
  const std::string consolidated = cluster_.dir() + "/hsdp.safetensors";
  auto [code, output] = testing::RunCommand(
      absl::StrCat(testing::RunfilePath("client/shardctl"), " --server=", cluster_.address(),
                   " consolidate --job=resumed --step=latest --out=", consolidated));
  ASSERT_EQ(code, 0) << output;
  // Resumed from the shard files at W = 2 in groups of 1 (every rank a
  // replica) for 3 more steps; and from the consolidated file at W = 3
  // without groups.
  ASSERT_TRUE(cluster_.Run(
      "resumed", 2,
      kMlp.Flags(6, {"--stage=3", "--batch=6", "--shard_group_size=1", "--resume=latest"})));
  ASSERT_TRUE(cluster_.Run("from-file", 3,
                           kMlp.Flags(6, {"--stage=3", "--batch=4", "--init_from=" + consolidated})));
  const Params reference = kMlp.Load(cluster_.checkpoint_root(), "uninterrupted", 6);
  const double bound = kMlp.Bound(6, 12, reference);
  ExpectWithinBound(MaxRelativeDifference(kMlp.Load(cluster_.checkpoint_root(), "resumed", 6), reference), bound,
                    "HSDP W=4 G=2, resumed at W=2 G=1");
  ExpectWithinBound(MaxRelativeDifference(kMlp.Load(cluster_.checkpoint_root(), "from-file", 6), reference), bound,
                    "HSDP W=4 G=2, consolidated, continued at W=3");
}

}  // namespace
}  // namespace zeroshard
