// Checkpoints from the workers' side, with real processes: resuming equals
// not stopping; a consolidated checkpoint continues at another world size;
// a worker killed mid-checkpoint leaves nothing that looks complete.
#include <signal.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "common/file_util.h"
#include "common/model_zoo.h"
#include "gtest/gtest.h"
#include "tests/testing/cluster.h"
#include "tests/testing/error_model.h"
#include "tests/testing/params.h"
#include "worker/checkpoint/shard_checkpoint.h"

namespace zeroshard {
namespace {

using testing::LocalCluster;
using testing::MaxRelativeDifference;
using testing::Params;

Params LoadStep(const LocalCluster& cluster, const std::string& job, int step);
constexpr int kLayers = 3;
constexpr int kWidth = 24;
constexpr double kLr = 0.01;
// GELU: no unit within rounding of a kink, as the error model of the
// resumption at another world size assumes (tests/testing/error_model.h).
constexpr char kActivation[] = "gelu";

std::vector<std::string> Flags(std::vector<std::string> extra) {
  std::vector<std::string> flags = {"--model=mlp",     absl::StrCat("--layers=", kLayers),
                                    absl::StrCat("--width=", kWidth),
                                    absl::StrCat("--activation=", kActivation),
                                    absl::StrCat("--lr=", kLr), "--seed=9",
                                    "--stage=3",       "--collective_timeout=30s"};
  flags.insert(flags.end(), extra.begin(), extra.end());
  return flags;
}

Params LoadStep(const LocalCluster& cluster, const std::string& job, int step) {
  return testing::LoadCheckpointParams(cluster.checkpoint_root(), job, step,
                                       *MlpSpec(kLayers, kWidth, kActivation));
}

class ResumeTest : public ::testing::Test {
 protected:
  ResumeTest() : cluster_(testing::MakeTempDir("resume")) {}
  LocalCluster cluster_;
};

TEST_F(ResumeTest, SixStepsEqualThreeStepsThenResumeAndThreeMore) {
  ASSERT_TRUE(cluster_.ok());
  ASSERT_TRUE(cluster_.Run("straight", 2, Flags({"--steps=6", "--batch=4", "--checkpoint_at_end"})));
  ASSERT_TRUE(cluster_.Run("stopped", 2, Flags({"--steps=3", "--batch=4", "--checkpoint_at_end"})));
  ASSERT_TRUE(cluster_.Run("stopped", 2, Flags({"--steps=6", "--batch=4", "--checkpoint_at_end",
                                                "--resume=latest"})));
  EXPECT_NE(cluster_.WorkerLog(0).find("restored"), std::string::npos) << cluster_.WorkerLog(0);
  // The same arithmetic in the same order (same W, same shards, the optimizer
  // state restored exactly): the same bits.
  EXPECT_EQ(LoadStep(cluster_, "stopped", 6), LoadStep(cluster_, "straight", 6));
  // The resumed run continued the step count: 3 more steps, not 6.
  EXPECT_EQ(cluster_.Report("stopped", 0)["losses"].size(), 3u);
  // Once more with the same --steps: nothing to train, and it says so.
  ASSERT_TRUE(cluster_.Run("stopped", 2, Flags({"--steps=6", "--batch=4", "--resume=latest"})));
  EXPECT_NE(cluster_.WorkerLog(0).find("the state restored is at step 6 and --steps=6: nothing "
                                       "to train"),
            std::string::npos)
      << cluster_.WorkerLog(0);
}

TEST_F(ResumeTest, ADamagedShardIsNeverLoaded) {
  ASSERT_TRUE(cluster_.ok());
  ASSERT_TRUE(cluster_.Run("damaged", 2, Flags({"--steps=2", "--batch=4", "--checkpoint_at_end"})));
  // One flipped byte inside rank 1's last tensor (after the header that
  // records the checksums).
  const std::string file = absl::StrCat(cluster_.checkpoint_root(), "/",
                                        CheckpointStepDir("damaged", 2), "/rank-1-of-2.safetensors");
  std::string bytes = testing::ReadFileOrEmpty(file);
  ASSERT_GT(bytes.size(), 16u);
  bytes[bytes.size() - 5] ^= 0x40;
  ASSERT_TRUE(WriteFileAtomically(file, bytes).ok());
  // Resuming must fail, naming the file, rather than train on the damage;
  // and at once: rank 1 does not re-join to meet the same damage until
  // --max_recoveries (10) ends it, and rank 0 does not wait for it. Rank 1
  // exits 2 (the job's input, as a bad flag); rank 0 is told why.
  cluster_.StartWorkers("damaged", 2, Flags({"--steps=4", "--batch=4", "--resume=latest"}));
  const std::vector<int> codes = cluster_.WaitWorkers(absl::Seconds(90));
  const std::string logs = cluster_.WorkerLog(0) + cluster_.WorkerLog(1);
  EXPECT_EQ(codes, (std::vector<int>{1, 2})) << logs << cluster_.server()->Log();
  EXPECT_NE(logs.find("does not match its recorded checksum"), std::string::npos) << logs;
  EXPECT_NE(logs.find("rank-1-of-2.safetensors"), std::string::npos) << logs;
  EXPECT_EQ(cluster_.WorkerLog(1).find("recovering ("), std::string::npos) << logs;
  EXPECT_NE(cluster_.WorkerLog(0).find("job 'damaged' failed: worker 'w1' (rank 1) failed: "
                                       "DATA_LOSS"),
            std::string::npos)
      << logs;
  EXPECT_NE(cluster_.server()->Log().find("event=job_failed "), std::string::npos)
      << cluster_.server()->Log();
}

// A --resume whose model is not the checkpoint's: the rank that reads a
// tensor of another shape fails, and so does the job at once (before, a
// rank whose shard read fine waited --rejoin_timeout, 5 minutes, for it).
TEST_F(ResumeTest, AResumeWithAnotherModelEndsEveryRankAtOnce) {
  ASSERT_TRUE(cluster_.ok());
  ASSERT_TRUE(cluster_.Run("model", 2, Flags({"--steps=1", "--batch=4", "--checkpoint_at_end"})));
  std::vector<std::string> wider = Flags({"--steps=2", "--batch=4", "--resume=latest"});
  wider.push_back(absl::StrCat("--width=", 2 * kWidth));
  cluster_.StartWorkers("model", 2, wider);
  const std::vector<int> codes = cluster_.WaitWorkers(absl::Seconds(90));
  const std::string logs = cluster_.WorkerLog(0) + cluster_.WorkerLog(1);
  ASSERT_EQ(codes.size(), 2u);
  int refused = 0;  // the ranks that read another shape: exit 2
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(codes[r] == 1 || codes[r] == 2) << "rank " << r << " exited " << codes[r] << logs;
    refused += codes[r] == 2;
    // A rank that read its shard fine exits 1, saying why the job failed.
    if (codes[r] == 1) {
      EXPECT_NE(cluster_.WorkerLog(r).find("failed: INVALID_ARGUMENT"), std::string::npos)
          << cluster_.WorkerLog(r);
    }
  }
  EXPECT_GE(refused, 1) << logs;
  EXPECT_NE(logs.find("is it a checkpoint of this model?"), std::string::npos) << logs;
}

// Read with another model's shapes, a sharded step is refused, naming the
// file and both shapes; before, the reader copied the file's rows into a
// buffer sized for the model's and wrote past it.
TEST_F(ResumeTest, AStepReadAsAnotherShapeIsRefusedNamingBoth) {
  ASSERT_TRUE(cluster_.ok());
  ASSERT_TRUE(cluster_.Run("shape", 2, Flags({"--steps=1", "--batch=4", "--checkpoint_at_end"})));
  auto reader = CheckpointReader::OpenStep(
      absl::StrCat(cluster_.checkpoint_root(), "/", CheckpointStepDir("shape", 1)));
  ASSERT_TRUE(reader.ok()) << reader.status();
  auto wider = MlpSpec(kLayers, 2 * kWidth, kActivation);
  ASSERT_TRUE(wider.ok());
  const TensorSpec& weight = wider->tensors[0];
  std::vector<float> values(weight.Elements());
  absl::Status s = (*reader)->ReadRows(CheckpointReader::Kind::kParams, weight, 0, weight.Rows(),
                                       values.data());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("is it a checkpoint of this model?"), std::string::npos) << s;
  EXPECT_NE(s.message().find(".safetensors"), std::string::npos) << s;
}

// Another run under a finished job's id, without --resume: its saves of the
// steps the first run completed are refused, and the first run's files stay
// as its manifest says (before, the worker's rename replaced them before
// the server refused the commit: "verified", but DATA_LOSS to consolidate).
TEST_F(ResumeTest, AnotherRunUnderTheSameJobIdLeavesACompleteCheckpointAlone) {
  ASSERT_TRUE(cluster_.ok());
  ASSERT_TRUE(cluster_.Run("same", 2, Flags({"--steps=4", "--batch=4", "--checkpoint_every=2"})));
  const std::string dir = absl::StrCat(cluster_.checkpoint_root(), "/", CheckpointStepDir("same", 2));
  const std::string before = testing::ReadFileOrEmpty(dir + "/rank-0-of-2.safetensors");
  ASSERT_FALSE(before.empty());
  const Params first = LoadStep(cluster_, "same", 2);
  // Another seed: other values at step 2.
  std::vector<std::string> again = Flags({"--steps=4", "--batch=4", "--checkpoint_every=2"});
  again.push_back("--seed=7");
  EXPECT_FALSE(cluster_.Run("same", 2, again));
  const std::string logs = cluster_.WorkerLog(0) + cluster_.WorkerLog(1);
  EXPECT_NE(logs.find("step 2 of job 'same' is a complete checkpoint already"), std::string::npos)
      << logs;
  EXPECT_NE(logs.find("--resume=latest"), std::string::npos) << logs;
  EXPECT_EQ(testing::ReadFileOrEmpty(dir + "/rank-0-of-2.safetensors"), before);
  EXPECT_EQ(LoadStep(cluster_, "same", 2), first);  // its checksums hold
}

TEST_F(ResumeTest, ConsolidatedCheckpointContinuesAtOtherWorldSizes) {
  ASSERT_TRUE(cluster_.ok());
  // Global batch 12 rows at every world size: W × batch.
  ASSERT_TRUE(cluster_.Run("uninterrupted", 4, Flags({"--steps=6", "--batch=3",
                                                      "--checkpoint_at_end"})));
  ASSERT_TRUE(cluster_.Run("first-half", 4, Flags({"--steps=3", "--batch=3",
                                                   "--checkpoint_at_end"})));
  std::string consolidated = cluster_.dir() + "/first-half.safetensors";
  auto [code, output] = testing::RunCommand(absl::StrCat(
      testing::RunfilePath("client/shardctl"), " --server=", cluster_.address(),
      " consolidate --job=first-half --step=latest --out=", consolidated));
  ASSERT_EQ(code, 0) << output;
  Params reference = LoadStep(cluster_, "uninterrupted", 6);
  // The last 3 steps sum in other orders at W = 2 and 3 (the ranks' reduction,
  // the rows per GEMM): tests/testing/error_model.h's Adam bound, 12 rows per
  // step, sums of <= max(width, 12) terms.
  testing::TrainingErrorModel model;
  model.layers = kLayers;
  model.sum_length = std::max(kWidth, 12);
  model.steps = 3;
  model.lr = kLr;
  model.param_scale = testing::SmallestTensorScale(reference);
  for (int world : {2, 3}) {
    std::string job = absl::StrCat("continued-w", world);
    ASSERT_TRUE(cluster_.Run(job, world,
                             Flags({"--steps=6", absl::StrCat("--batch=", 12 / world),
                                    "--checkpoint_at_end", "--init_from=" + consolidated})));
    testing::ExpectWithinBound(MaxRelativeDifference(LoadStep(cluster_, job, 6), reference),
                               testing::AdamRelativeParamBound(model), absl::StrCat("W=", world));
  }
}

TEST_F(ResumeTest, AWorkerKilledWhileCheckpointingLeavesNothingThatLooksComplete) {
  ASSERT_TRUE(cluster_.ok());
  // Big enough that writes take a moment; a checkpoint every step.
  cluster_.StartWorkers("crash", 2,
                        {"--model=mlp", "--layers=4", "--width=512", "--steps=100000",
                         "--batch=4", "--stage=3", "--checkpoint_every=1",
                         "--collective_timeout=20s", "--max_recoveries=0"});
  ASSERT_TRUE(testing::WaitFor(
      [&] { return cluster_.WorkerLog(0).find("step 4/") != std::string::npos; },
      absl::Seconds(60)))
      << cluster_.WorkerLog(0) << cluster_.WorkerLog(1);
  cluster_.worker(1)->Signal(SIGKILL);
  EXPECT_NE(cluster_.worker(0)->Wait(absl::Seconds(30)), 0);

  ClientOptions options;
  options.server = cluster_.address();
  auto client = Client::Connect(options);
  ASSERT_TRUE(client.ok());
  auto listed = (*client)->ListCheckpoints("crash");
  ASSERT_TRUE(listed.ok()) << listed.status();
  int64_t latest_complete = -1;
  auto spec = MlpSpec(4, 512, "none");
  for (const v1::CheckpointInfo& info : listed->checkpoints()) {
    std::string step_dir = absl::StrCat(cluster_.checkpoint_root(), "/",
                                        CheckpointStepDir("crash", info.step()));
    bool has_manifest =
        !testing::ReadFileOrEmpty(step_dir + "/manifest.json").empty();
    EXPECT_EQ(has_manifest, info.complete()) << "step " << info.step();
    if (!info.complete()) continue;
    latest_complete = std::max(latest_complete, info.step());
    // A complete step reads back whole.
    auto reader = CheckpointReader::OpenStep(step_dir);
    ASSERT_TRUE(reader.ok());
    for (const TensorSpec& t : spec->tensors) {
      std::vector<float> values(t.Elements());
      EXPECT_TRUE((*reader)
                      ->ReadRows(CheckpointReader::Kind::kParams, t, 0, t.Rows(), values.data())
                      .ok())
          << "step " << info.step() << " " << t.name;
    }
  }
  EXPECT_GE(latest_complete, 1);
  // And the job can resume from it.
  EXPECT_EQ(LatestCompleteStep(cluster_.checkpoint_root(), "crash"), latest_complete);
}

}  // namespace
}  // namespace zeroshard
