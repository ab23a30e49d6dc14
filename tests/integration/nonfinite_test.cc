// Non-finite steps (issue #43): data rows holding NaN, +Inf or 1e30 at a
// step, fed from a real data file to real shard_server and shard_worker
// processes on loopback, in f32, in int8 (--gather_dtype=int8
// --reduce_dtype=int8, W = 2) and in HSDP with int8 (W = 4, groups of 2),
// with and without --max_grad_norm.
//
//   --on_nonfinite=stop: every rank exits 1 at that step (rank 0 printed no
//   progress line for it) with the line naming the step, the quantity, the
//   first rank and its file rows.
//   --on_nonfinite=skip: the run finishes with finite parameters that are
//   bitwise those of a run whose data file lacked the bad steps' rows (and
//   ran that many steps fewer): the skipped steps changed no parameter, no
//   Adam moment and no step count, and every other step saw the same rows
//   on the same ranks, reduced in the same order (int8 rounds to nearest, a
//   function of the values alone; the learning rate is constant).
#include <sys/stat.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/model_zoo.h"
#include "common/safetensors.h"
#include "gtest/gtest.h"
#include "tests/testing/cluster.h"
#include "tests/testing/params.h"
#include "tests/testing/process.h"
#include "worker/data/regression_data.h"

namespace zeroshard {
namespace {

using testing::LocalCluster;
using testing::Params;

constexpr int kLayers = 2;
constexpr int kWidth = 16;
constexpr int kBatch = 4;  // rows per rank per step
constexpr int kSteps = 8;

// How a run communicates, and its world size.
struct Mode {
  const char* name;
  int world;
  std::vector<std::string> flags;
};

std::vector<Mode> Modes() {
  return {{"f32", 2, {}},
          {"int8", 2, {"--gather_dtype=int8", "--reduce_dtype=int8"}},
          {"hsdp_int8", 4, {"--shard_group_size=2", "--gather_dtype=int8", "--reduce_dtype=int8"}}};
}

// A bad value planted in x of one row of rank 1's batch at a (0-based)
// step: NaN, +Inf, and 1e30 (finite in f32; its squared error, 1e58 in
// the double MSE, is beyond float32's range).
struct BadRow {
  int step;
  float value;
  const char* name;
};
const BadRow kNaN{2, std::numeric_limits<float>::quiet_NaN(), "nan"};
const BadRow kInf{4, std::numeric_limits<float>::infinity(), "inf"};
const BadRow kHuge{6, 1e30f, "1e30"};

// Writes the synthetic rows of `steps` steps for `world` ranks to `path`,
// leaving out the rows of the steps in `dropped` and planting each of
// `bad` in rank 1's second row of its step.
void WriteData(const std::string& path, int world, int steps, const std::vector<BadRow>& bad,
               const std::set<int>& dropped) {
  const int64_t per_step = int64_t{kBatch} * world;
  const SyntheticRegressionData synthetic(/*seed=*/7, kWidth);
  std::vector<float> x, y;
  for (int step = 0; step < steps; ++step) {
    if (dropped.count(step)) continue;
    std::vector<float> sx(per_step * kWidth), sy(per_step * kWidth);
    ASSERT_TRUE(synthetic.FillRows(step * per_step, per_step, sx.data(), sy.data()).ok());
    for (const BadRow& b : bad) {
      if (b.step == step) sx[(1 * kBatch + 1) * kWidth + 3] = b.value;
    }
    x.insert(x.end(), sx.begin(), sx.end());
    y.insert(y.end(), sy.begin(), sy.end());
  }
  const int64_t rows = static_cast<int64_t>(x.size()) / kWidth;
  auto writer = SafetensorsWriter::Create(
      path, {{"x", DType::kF32, {rows, kWidth}}, {"y", DType::kF32, {rows, kWidth}}});
  ASSERT_TRUE(writer.ok()) << writer.status();
  ASSERT_TRUE((*writer)->Append(x.data(), x.size() * sizeof(float)).ok());
  ASSERT_TRUE((*writer)->Append(y.data(), y.size() * sizeof(float)).ok());
  ASSERT_TRUE((*writer)->Finish().ok());
}

std::vector<std::string> Flags(const Mode& mode, const std::string& data, int steps,
                               std::vector<std::string> extra) {
  std::vector<std::string> flags = {"--model=mlp",
                                    absl::StrCat("--layers=", kLayers),
                                    absl::StrCat("--width=", kWidth),
                                    "--activation=gelu",
                                    absl::StrCat("--batch=", kBatch),
                                    absl::StrCat("--steps=", steps),
                                    "--stage=3",
                                    "--lr=0.01",
                                    "--seed=3",
                                    absl::StrCat("--data=", data),
                                    "--checkpoint_at_end",
                                    "--collective_timeout=30s"};
  flags.insert(flags.end(), mode.flags.begin(), mode.flags.end());
  flags.insert(flags.end(), extra.begin(), extra.end());
  return flags;
}

class NonFiniteTest : public ::testing::TestWithParam<Mode> {
 protected:
  NonFiniteTest() : cluster_(testing::MakeTempDir("nonfinite")) {}
  std::string DataPath(const std::string& name) const {
    return absl::StrCat(cluster_.dir(), "/", name, ".safetensors");
  }
  LocalCluster cluster_;
};

TEST_P(NonFiniteTest, StopExitsEveryRankAtTheStepNamingItsRankAndRows) {
  const Mode& mode = GetParam();
  ASSERT_TRUE(cluster_.ok());
  // Every value with and without clipping: a NaN norm fails
  // `norm > max_grad_norm` and skipped the clip, so a clipped run must stop too.
  for (const BadRow& bad : {kNaN, kInf, kHuge}) {
    for (const char* clip : {"--max_grad_norm=0", "--max_grad_norm=1"}) {
      const std::string job = absl::StrCat("stop-", bad.name, "-clip", std::string(1, clip[16]));
      const std::string data = DataPath(job);
      WriteData(data, mode.world, kSteps, {bad}, {});
      cluster_.StartWorkers(job, mode.world, Flags(mode, data, kSteps, {clip}));
      const std::vector<int> codes = cluster_.WaitWorkers(absl::Seconds(120));
      const int64_t first_row = (int64_t{bad.step} * mode.world + 1) * kBatch;
      const std::string expected =
          absl::StrCat("step ", bad.step + 1, "/", kSteps, ": the loss is ");
      const std::string rows =
          absl::StrCat("on rank 1 (its data: rows ", first_row, "-", first_row + kBatch - 1, " of ",
                       data, "); stopping (--on_nonfinite=stop)");
      for (int rank = 0; rank < mode.world; ++rank) {
        const std::string log = cluster_.WorkerLog(rank);
        EXPECT_EQ(codes[rank], 1) << bad.name << " " << clip << ", rank " << rank << ":\n" << log;
        EXPECT_NE(log.find(expected), std::string::npos) << bad.name << ", rank " << rank << ":\n"
                                                         << log;
        EXPECT_NE(log.find(rows), std::string::npos) << bad.name << ", rank " << rank << ":\n"
                                                     << log;
      }
      // Within the step: rank 0 reported the step before and not this one.
      const std::string log0 = cluster_.WorkerLog(0);
      const size_t at = log0.find("shard_worker rank 0: step ");
      if (at != std::string::npos) {
        std::printf("%s, %s, %s: %s\n", mode.name, bad.name, clip,
                    log0.substr(at, log0.find('\n', at) - at).c_str());
      }
      EXPECT_NE(log0.find(absl::StrCat("step ", bad.step, "/", kSteps, "  loss")),
                std::string::npos)
          << log0;
      EXPECT_EQ(log0.find(absl::StrCat("step ", bad.step + 1, "/", kSteps, "  loss")),
                std::string::npos)
          << log0;
    }
  }
}

TEST_P(NonFiniteTest, SkipEqualsARunWhoseDataLackedTheBadRows) {
  const Mode& mode = GetParam();
  ASSERT_TRUE(cluster_.ok());
  const std::vector<BadRow> bad = {kNaN, kInf, kHuge};
  const std::set<int> bad_steps = {kNaN.step, kInf.step, kHuge.step};
  const int clean_steps = kSteps - static_cast<int>(bad_steps.size());
  const std::string bad_data = DataPath("bad"), clean_data = DataPath("clean");
  WriteData(bad_data, mode.world, kSteps, bad, {});
  WriteData(clean_data, mode.world, kSteps, {}, bad_steps);
  const absl::StatusOr<ModelSpec> spec = MlpSpec(kLayers, kWidth, "gelu");
  ASSERT_TRUE(spec.ok());
  for (const char* clip : {"--max_grad_norm=0", "--max_grad_norm=1"}) {
    const std::string skip_job = absl::StrCat("skip", std::string(1, clip[16]));
    const std::string clean_job = absl::StrCat("clean", std::string(1, clip[16]));
    ASSERT_TRUE(cluster_.Run(skip_job, mode.world,
                             Flags(mode, bad_data, kSteps, {clip, "--on_nonfinite=skip"})));
    ASSERT_TRUE(cluster_.Run(clean_job, mode.world, Flags(mode, clean_data, clean_steps, {clip})));
    const nlohmann::json report = cluster_.Report(skip_job, 0);
    std::vector<int> numbered;  // as the log's "step N/M": 1-based
    for (int s : bad_steps) numbered.push_back(s + 1);
    EXPECT_EQ(report["skipped_steps"], nlohmann::json(numbered)) << clip;
    const Params skipped =
        testing::LoadCheckpointParams(cluster_.checkpoint_root(), skip_job, kSteps, *spec);
    const Params clean =
        testing::LoadCheckpointParams(cluster_.checkpoint_root(), clean_job, clean_steps, *spec);
    ASSERT_FALSE(clean.empty());
    for (const auto& [name, values] : skipped) {
      for (float v : values) ASSERT_TRUE(std::isfinite(v)) << clip << ": " << name;
    }
    EXPECT_EQ(skipped, clean) << clip << ": the skipped steps changed something";
  }
}

// The policy is the same in every mode: f32 only.
TEST(NonFiniteLimitTest, SkipStopsAfterMaxSkippedStepsInARow) {
  LocalCluster cluster(testing::MakeTempDir("nonfinite_limit"));
  ASSERT_TRUE(cluster.ok());
  const Mode mode = Modes()[0];
  const std::string data = cluster.dir() + "/three.safetensors";
  WriteData(data, mode.world, kSteps, {{2, NAN, "nan"}, {3, NAN, "nan"}, {4, NAN, "nan"}}, {});
  cluster.StartWorkers("limit", mode.world,
                       Flags(mode, data, kSteps, {"--on_nonfinite=skip", "--max_skipped_steps=2"}));
  const std::vector<int> codes = cluster.WaitWorkers(absl::Seconds(120));
  for (int rank = 0; rank < mode.world; ++rank) {
    const std::string log = cluster.WorkerLog(rank);
    EXPECT_EQ(codes[rank], 1) << log;
    EXPECT_NE(log.find("step 5/8: the loss is nan on rank 1"), std::string::npos) << log;
    EXPECT_NE(log.find("3 steps in a row were not finite (--max_skipped_steps=2)"),
              std::string::npos)
        << log;
  }
}

// Nothing non-finite is saved, and --keep_last keeps the newest finite step:
// a job checkpoints steps 1-3, then resumes with a learning rate of 1e39, so
// step 4's update overflows the parameters after a finite verdict (the
// verdict judges the gradients, not the update). Step 4's checkpoint is
// refused on every rank before anything is written and abandoned (a retry
// at step 5), step 5's loss is not finite and every rank stops; step 3 is
// still the newest complete checkpoint.
TEST(NonFiniteCheckpointTest, AnOverflowedUpdateIsNeverSavedAndKeepLastKeepsTheNewestFiniteStep) {
  const std::string dir = testing::MakeTempDir("nonfinite_checkpoint");
  LocalCluster cluster(dir, {"--keep_last=2"});
  ASSERT_TRUE(cluster.ok());
  const Mode mode = Modes()[0];
  const std::string data = dir + "/clean.safetensors";
  WriteData(data, mode.world, 6, {}, {});
  ASSERT_TRUE(cluster.Run("keep", mode.world, Flags(mode, data, 3, {"--checkpoint_every=1"})));
  cluster.StartWorkers(
      "keep", mode.world,
      Flags(mode, data, 6, {"--checkpoint_every=1", "--resume=latest", "--lr=1e39"}));
  const std::vector<int> codes = cluster.WaitWorkers(absl::Seconds(120));
  const std::string root = cluster.checkpoint_root() + "/keep";
  for (int rank = 0; rank < mode.world; ++rank) {
    const std::string log = cluster.WorkerLog(rank);
    EXPECT_EQ(codes[rank], 1) << log;
    EXPECT_NE(log.find(absl::StrCat("checkpoint step 4 failed on rank ", rank,
                                    ": shard of job keep step 4 rank ", rank, ": tensor ")),
              std::string::npos)
        << log;
    EXPECT_NE(log.find(": not saved (a checkpoint or snapshot keeps finite values only"),
              std::string::npos)
        << log;
    EXPECT_NE(log.find("step 5/6: the loss is"), std::string::npos) << log;
    struct stat st;
    EXPECT_NE(stat(absl::StrCat(root, "/step-4/rank-", rank, "-of-2.safetensors").c_str(), &st), 0);
  }
  struct stat st;
  EXPECT_NE(stat((root + "/step-4/manifest.json").c_str(), &st), 0);
  EXPECT_EQ(stat((root + "/step-3/manifest.json").c_str(), &st), 0)
      << "the newest finite step was deleted";
}

// A GPT on a text file whose first update overflows (a learning rate of
// 1e39): the next step's loss is not finite and the line names the first
// rank's training samples of the file.
TEST(NonFiniteGptTest, StopNamesTheTrainingSamplesOfATextFile) {
  const std::string dir = testing::MakeTempDir("nonfinite_gpt");
  LocalCluster cluster(dir);
  ASSERT_TRUE(cluster.ok());
  const std::string text = dir + "/corpus.txt";
  std::string corpus;
  for (int i = 0; i < 100; ++i) corpus += "the quick brown fox jumps over the lazy dog\n";
  testing::WriteFile(text, corpus);
  cluster.StartWorkers("gpt", 2,
                       {"--model=gpt", "--layers=1", "--heads=2", "--d_model=16", "--context=16",
                        "--batch=2", absl::StrCat("--data=", text), "--steps=4", "--lr=1e39",
                        "--seed=1", "--collective_timeout=30s"});
  const std::vector<int> codes = cluster.WaitWorkers(absl::Seconds(120));
  for (int rank = 0; rank < 2; ++rank) {
    const std::string log = cluster.WorkerLog(rank);
    EXPECT_EQ(codes[rank], 1) << log;
    // Step 2 (0-based 1), rank 0: global samples ((1 * 2) + 0) * 2 = 4, 5.
    EXPECT_NE(log.find(absl::StrCat("step 2/4: the loss is nan on rank 0 (its data: training "
                                    "samples 4-5 of ",
                                    text)),
              std::string::npos)
        << log;
  }
}

// The server shows the skipped steps per job: shardctl status and /metrics
// (zeroshard_job_skipped_steps_total), from the ranks' heartbeats, while the job
// runs (steps stretched so that it runs long enough to be asked).
TEST(NonFiniteStatusTest, SkippedStepsShowInShardctlStatusAndMetrics) {
  const std::string dir = testing::MakeTempDir("nonfinite_status");
  LocalCluster cluster(dir,
                       {"--metrics_listen=127.0.0.1:0", "--metrics_port_file=" + dir + "/mport",
                        "--heartbeat_interval_ms=100"});
  ASSERT_TRUE(cluster.ok());
  const Mode mode = Modes()[0];
  constexpr int kLongSteps = 40;
  const std::string data = dir + "/bad.safetensors";
  WriteData(data, mode.world, kLongSteps, {kNaN}, {});
  cluster.StartWorkers(
      "status", mode.world,
      Flags(mode, data, kLongSteps, {"--on_nonfinite=skip", "--test_step_delay_ms=150"}));
  const std::string shardctl =
      absl::StrCat(testing::RunfilePath("client/shardctl"), " --server=", cluster.address());
  const std::string line = "status skipped steps: 1 (non-finite loss or gradient norm";
  std::string status, metrics;
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  bool shown = false;
  while (!shown && absl::Now() < deadline) {
    status = testing::RunCommand(shardctl + " status --job=status").second;
    std::string port = testing::ReadFileOrEmpty(dir + "/mport");
    metrics =
        testing::RunCommand(
            absl::StrCat("curl -s http://127.0.0.1:", absl::StripAsciiWhitespace(port), "/metrics"))
            .second;
    shown =
        status.find(line) != std::string::npos &&
        metrics.find("zeroshard_job_skipped_steps_total{job=\"status\"} 1\n") != std::string::npos;
    if (!shown) absl::SleepFor(absl::Milliseconds(100));
  }
  EXPECT_TRUE(shown) << "shardctl status:\n" << status << "\n/metrics:\n" << metrics;
  EXPECT_EQ(cluster.WaitWorkers(absl::Seconds(120)), std::vector<int>(mode.world, 0))
      << cluster.WorkerLog(0);
}

INSTANTIATE_TEST_SUITE_P(Modes, NonFiniteTest, ::testing::ValuesIn(Modes()),
                         [](const ::testing::TestParamInfo<Mode>& info) {
                           return std::string(info.param.name);
                         });

}  // namespace
}  // namespace zeroshard
