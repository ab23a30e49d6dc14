// Int8 communication (--gather_dtype=int8 --reduce_dtype=int8) trains the
// quickstart's GPT as f32 does: W = 4 as 2 shard groups of 2 (the group's
// quantized gathers; its reduce-scatter, in shared memory, stays f32; the
// replicas' quantized all-reduce); real server and worker processes on
// loopback. The quantized all-to-all reduce-scatter runs in the flat int8
// modes (quantized_test, multihost_bench's flat-int8).
//
// Tolerance. Each value a step communicates is quantized once per
// collective (worker/comm/quantized.h): a parameter errs by at most
// max|block| / 254 in the forward and backward, a gradient contribution by
// its block's max / 254 in each quantized reduction (here one, the replicas'
// all-reduce; max / 127 with --int8_reduce_rounding=stochastic). That is
// noise of up to 0.4 % of a block's largest value per element on every
// step, which does not shrink with steps; there is no bound of it on a loss after training
// short of the f64 propagation the unit tests do. The check is the issue's
// acceptance criterion instead: the final validation loss within 1 % of the
// f32 run's (docs/quantized_comm.md shows the whole 1,800-step quickstart,
// whose held-out sums this short run cannot reach).
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/testing/cluster.h"

namespace zeroshard {
namespace {

using testing::LocalCluster;

constexpr int kSteps = 30;

std::vector<std::string> QuickstartFlags(std::vector<std::string> extra) {
  // deploy/quickstart.sh's model, task and optimizer, for kSteps steps.
  std::vector<std::string> flags = {
      "--model=gpt",        "--layers=3",          "--heads=4",
      "--d_model=96",       "--context=32",        "--task=reversed-addition",
      "--digits=2",         "--loss_on=answers",   "--batch=16",
      absl::StrCat("--steps=", kSteps),            "--stage=3",
      "--prefetch=1",       "--optimizer=adamw",   "--lr=3e-3",
      "--min_lr=3e-4",      "--lr_schedule=cosine", "--warmup_steps=100",
      "--max_grad_norm=1.0", absl::StrCat("--val_every=", kSteps), "--seed=1",
      "--threads=1",        "--shard_group_size=2", "--collective_timeout=30s"};
  flags.insert(flags.end(), extra.begin(), extra.end());
  return flags;
}

TEST(QuantizedTrainingTest, Int8GathersAndReductionsTrainTheGptAsF32Does) {
  LocalCluster cluster(testing::MakeTempDir("quantized"));
  ASSERT_TRUE(cluster.ok());
  ASSERT_TRUE(cluster.Run("f32", 4, QuickstartFlags({})));
  ASSERT_TRUE(cluster.Run("int8", 4, QuickstartFlags({"--gather_dtype=int8", "--reduce_dtype=int8"})));
  const nlohmann::json f32 = cluster.Report("f32", 0);
  const nlohmann::json int8 = cluster.Report("int8", 0);
  const double f32_loss = f32["val_loss"];
  const double int8_loss = int8["val_loss"];
  std::printf("validation loss after %d steps: f32 %.6f, int8 %.6f (%+.3f %%)\n", kSteps,
              f32_loss, int8_loss, 100 * (int8_loss - f32_loss) / f32_loss);
  EXPECT_LT(int8_loss, 0.9 * int8["losses"].front().get<double>()) << "int8 did not train";
  EXPECT_NEAR(int8_loss, f32_loss, 0.01 * f32_loss)
      << "validation loss after " << kSteps << " steps: int8 " << int8_loss << ", f32 "
      << f32_loss;
  // The quantized collectives moved int8 plus a scale per 256 values:
  // (1 + 4/256) / 4 = 0.254 of the f32 bytes; the small f32 collectives
  // (loss, norms) add little. The int8 all-reduce runs as an all-gather of
  // the quantized buffers, so gathers and all-reduces are counted together.
  // A group inside one host (shared memory) reduce-scatters in f32, the same
  // bytes as f32's: only the replicas' all-reduce is quantized
  // (EngineOptions::int8_group_reduce_in_f32). Every rank, so that a rank
  // left on f32 shows.
  const bool group_in_shm = int8["data_plane"]["reduce"]["transport"] == "shm";
  for (int rank = 0; rank < 4; ++rank) {
    auto sent = [&](const std::string& job, std::vector<const char*> ops) {
      const nlohmann::json bytes = cluster.Report(job, rank)["comm_bytes"];
      double sum = 0;
      for (const char* op : ops) sum += bytes.at(op).get<double>();
      return sum;
    };
    std::vector<const char*> quantized = {"all_gather", "all_reduce", "broadcast"};
    if (!group_in_shm) quantized.push_back("reduce_scatter");
    const double f32_bytes = sent("f32", quantized), int8_bytes = sent("int8", quantized);
    std::printf("rank %d: bytes sent by the quantized collectives: f32 %.0f, int8 %.0f (%.3f)\n",
                rank, f32_bytes, int8_bytes, int8_bytes / f32_bytes);
    EXPECT_LT(int8_bytes, 0.3 * f32_bytes) << "rank " << rank;
    if (group_in_shm) {
      EXPECT_EQ(sent("int8", {"reduce_scatter"}), sent("f32", {"reduce_scatter"}))
          << "rank " << rank << ": the group's reduce-scatter stays f32 in shared memory";
    }
  }
}

}  // namespace
}  // namespace zeroshard
