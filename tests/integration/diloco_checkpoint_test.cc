// DiLoCo's outer state in checkpoints (docs/diloco.md, "Checkpoints"), with
// real server and worker processes on loopback: a W = 4 job in 2 shard
// groups of 2 with outer Nesterov momentum saves its anchor, its outer
// momentum and its outer step count beside the parameters; the server's
// consolidation writes them into safetensors as optim.outer_anchor.<name>
// and optim.outer_momentum.<name>; the run resumes from them at the same W
// (bitwise the uninterrupted run) and at W = 2 in 2 groups of 1, from the
// shard files and from the consolidated file (within the summation-order
// error model below), while a resume that drops the momentum lands farther
// than that bound. A job without --sync=diloco ignores the outer state,
// saying so. In-memory snapshots carry the outer state too: a worker killed
// and replaced mid-run recovers bitwise into the uninterrupted run, outer
// momentum included.
#include <signal.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "common/safetensors.h"
#include "gtest/gtest.h"
#include "tests/testing/cluster.h"
#include "tests/testing/error_model.h"
#include "tests/testing/params.h"
#include "tests/testing/process.h"
#include "tests/testing/small_mlp.h"

namespace zeroshard {
namespace {

using testing::ExpectWithinBound;
using testing::kFloat32Unit;
using testing::LocalCluster;
using testing::MaxRelativeDifference;
using testing::Params;

const testing::SmallMlp kMlp;  // 3 x 32, GELU, lr 0.01, seed 3

constexpr int kSteps = 6;                          // 3 outer steps of H = 2
constexpr int kSaved = 4;                          // the checkpoint resumed: after outer step 2
constexpr double kOuterLr = 0.7, kMomentum = 0.9;  // DiLoCo's (the flags' defaults)

// Inner SGD without momentum: the inner optimizer keeps no state, so what a
// resume restores beyond the parameters is the outer state alone. f32
// outer all-reduce: no residual (a bf16 / int8 one restarts at zero).
// Global batch 8 rows: W x --batch.
std::vector<std::string> DiLoCoFlags(int steps, int world, int group,
                                     const std::vector<std::string>& extra) {
  std::vector<std::string> flags = {"--stage=3",
                                    "--optimizer=sgd",
                                    absl::StrCat("--batch=", 8 / world),
                                    absl::StrCat("--shard_group_size=", group),
                                    "--sync=diloco",
                                    "--outer_every=2",
                                    absl::StrCat("--outer_lr=", kOuterLr),
                                    absl::StrCat("--outer_momentum=", kMomentum),
                                    "--checkpoint_every=2"};
  flags.insert(flags.end(), extra.begin(), extra.end());
  return kMlp.Flags(steps, flags);
}

double MaxAbs(const std::vector<float>& v) {
  double m = 0;
  for (float x : v) m = std::max(m, std::fabs(static_cast<double>(x)));
  return m;
}

class DiLoCoCheckpointTest : public ::testing::Test {
 protected:
  DiLoCoCheckpointTest() : cluster_(testing::MakeTempDir("diloco_checkpoint")) {}

  // `job`'s latest step merged by the server into one safetensors file.
  std::string Consolidate(const std::string& job) {
    const std::string out = absl::StrCat(cluster_.dir(), "/", job, ".safetensors");
    auto [code, output] = testing::RunCommand(
        absl::StrCat(testing::RunfilePath("client/shardctl"), " --server=", cluster_.address(),
                     " consolidate --job=", job, " --step=latest --out=", out));
    EXPECT_EQ(code, 0) << output;
    return out;
  }

  // The uninterrupted run (kSteps) and `job` saved after kSaved steps,
  // both W = 4 in 2 groups of 2; its checkpoint at kSaved is right after
  // outer step 2.
  Params RunUninterruptedAndSave(const std::string& job,
                                 const std::vector<std::string>& extra = {}) {
    EXPECT_TRUE(cluster_.Run("uninterrupted", 4, DiLoCoFlags(kSteps, 4, 2, {})));
    EXPECT_TRUE(cluster_.Run(job, 4, DiLoCoFlags(kSaved, 4, 2, extra)));
    return kMlp.Load(cluster_.checkpoint_root(), "uninterrupted", kSteps);
  }

  // The bound on MaxRelativeDifference between the uninterrupted run and
  // one resumed at W = 2 in 2 groups of 1. Each group trains on the rows it
  // did at W = 4 (group g: rows [(4 s + 2 g) b, (4 s + 2 g + 2) b) of step
  // s, b = 2), so only the summation order differs. Error model: from
  // identical state at step 4, the two inner SGD steps of each group differ
  // by error_model.h's bound B (relative to each tensor's scale; 4 rows a
  // step, sums of <= 32 terms); the outer step then scales the mean of the
  // groups' parameters by c = outer_lr (1 + momentum) (Nesterov:
  // buf' = momentum buf + d and the update d + momentum buf',
  // d = anchor - mean; anchor and buf identical); its f32 roundings on
  // inputs that differ (d, the mean, buf', the update, the anchor's) can
  // each round apart by u of their operand, in both runs: at most
  // 2 x 5 u (max|anchor| + c max|d| + max|buf|) <= 10 u (2 + c) relative,
  // with |d|, |buf| below max|p| here.
  static double ResumeBound(const Params& reference) {
    const double c = kOuterLr * (1 + kMomentum);
    return c * kMlp.Bound(2, 4, reference) + 10 * kFloat32Unit * (2 + c);
  }

  LocalCluster cluster_;
};

// The consolidated file holds every tensor's anchor and outer momentum
// beside it, and the outer step count; the run resumes from it and from the
// shard files at W = 2 in 2 groups of 1 within ResumeBound, and the outer
// step count goes on.
TEST_F(DiLoCoCheckpointTest, TheOuterStateConsolidatesAndResumesAtAnotherWorldAndGroupCount) {
  ASSERT_TRUE(cluster_.ok());
  const Params reference = RunUninterruptedAndSave("saved");
  // Saved right after an outer step, the anchor is the parameters, bit for
  // bit; the momentum, two outer gradients' worth, is not zero.
  const std::string consolidated = Consolidate("saved");
  const Params file = testing::LoadSafetensorsParams(consolidated);
  const Params params = kMlp.Load(cluster_.checkpoint_root(), "saved", kSaved);
  ASSERT_FALSE(params.empty());
  for (const auto& [name, values] : params) {
    ASSERT_EQ(file.count("optim.outer_anchor." + name), 1u) << name;
    ASSERT_EQ(file.count("optim.outer_momentum." + name), 1u) << name;
    EXPECT_EQ(file.at(name), values) << name;
    EXPECT_EQ(file.at("optim.outer_anchor." + name), values) << name;
    EXPECT_GT(MaxAbs(file.at("optim.outer_momentum." + name)), 0.0) << name;
  }
  EXPECT_EQ(file.size(), 3 * params.size());  // no inner moments: inner SGD keeps none
  auto reader = SafetensorsReader::Open(consolidated);
  ASSERT_TRUE(reader.ok()) << reader.status();
  EXPECT_EQ((*reader)->metadata().at("outer_step"), "2");

  // From the consolidated file, and from the shard files (a job resumed at
  // another W reads every rank's file).
  const double bound = ResumeBound(reference);
  ASSERT_TRUE(
      cluster_.Run("from-file", 2, DiLoCoFlags(kSteps, 2, 1, {"--init_from=" + consolidated})));
  ExpectWithinBound(
      MaxRelativeDifference(kMlp.Load(cluster_.checkpoint_root(), "from-file", kSteps), reference),
      bound, "DiLoCo W=4 G=2, consolidated, continued at W=2 G=1");
  ASSERT_TRUE(cluster_.Run("saved", 2, DiLoCoFlags(kSteps, 2, 1, {"--resume=latest"})));
  EXPECT_NE(cluster_.WorkerLog(0).find("outer step 2, anchor and outer momentum"),
            std::string::npos)
      << cluster_.WorkerLog(0);
  ExpectWithinBound(
      MaxRelativeDifference(kMlp.Load(cluster_.checkpoint_root(), "saved", kSteps), reference),
      bound, "DiLoCo W=4 G=2, shard files, resumed at W=2 G=1");
  // The third outer step is number 3.
  const nlohmann::json report = cluster_.Report("saved", 0);
  ASSERT_EQ(report["outer_steps"].size(), 1u);
  EXPECT_EQ(report["outer_steps"][0]["after_step"].get<int>(), kSteps);
  EXPECT_EQ(report["outer_steps"][0]["outer_step"].get<int>(), 3);

  // Four groups of one from the same file: another group count (another
  // DiLoCo run from there on, whose groups see half the rows each, so not
  // compared), restoring the same outer state.
  ASSERT_TRUE(
      cluster_.Run("four-groups", 4, DiLoCoFlags(kSteps, 4, 1, {"--init_from=" + consolidated})));
  EXPECT_NE(cluster_.WorkerLog(0).find("outer step 2, anchor and outer momentum"),
            std::string::npos)
      << cluster_.WorkerLog(0);
  EXPECT_EQ(cluster_.Report("four-groups", 0)["outer_steps"][0]["outer_step"].get<int>(), 3);

  // Every-step HSDP from the DiLoCo checkpoint: the outer state is ignored,
  // said once.
  ASSERT_TRUE(cluster_.Run(
      "plain", 2,
      kMlp.Flags(kSaved + 1, {"--stage=3", "--optimizer=sgd", "--batch=4", "--shard_group_size=1",
                              "--init_from=" + consolidated})));
  EXPECT_NE(cluster_.WorkerLog(0).find("holds DiLoCo's outer state"), std::string::npos)
      << cluster_.WorkerLog(0);
}

// Same W and groups, from the shard files: the same sums on the same rows
// from the same state, bitwise the uninterrupted run.
TEST_F(DiLoCoCheckpointTest, ResumedAtTheSameWorldTheRunIsBitwiseTheUninterruptedOne) {
  ASSERT_TRUE(cluster_.ok());
  const Params reference = RunUninterruptedAndSave("same-w");
  ASSERT_TRUE(cluster_.Run("same-w", 4, DiLoCoFlags(kSteps, 4, 2, {"--resume=latest"})));
  EXPECT_EQ(kMlp.Load(cluster_.checkpoint_root(), "same-w", kSteps), reference);
}

// Without the outer momentum (a checkpoint saved without optimizer state
// has no outer state: the resume starts it fresh, saying so) the third
// outer step lacks outer_lr x momentum^2 x the buffer and lands farther
// from the uninterrupted run than ResumeBound: that bound would catch a
// resume that lost the momentum.
TEST_F(DiLoCoCheckpointTest, AResumeWithoutTheOuterMomentumLandsFartherThanTheBound) {
  ASSERT_TRUE(cluster_.ok());
  const Params reference = RunUninterruptedAndSave("dropped", {"--save_optimizer=false"});
  ASSERT_TRUE(cluster_.Run("dropped", 4, DiLoCoFlags(kSteps, 4, 2, {"--resume=latest"})));
  EXPECT_NE(cluster_.WorkerLog(0).find("has no DiLoCo outer state; it starts fresh"),
            std::string::npos)
      << cluster_.WorkerLog(0);
  const double dropped =
      MaxRelativeDifference(kMlp.Load(cluster_.checkpoint_root(), "dropped", kSteps), reference);
  const double bound = ResumeBound(reference);
  EXPECT_GT(dropped, bound) << "a resume without the outer momentum";
  std::fprintf(stderr, "without the outer momentum: %.3g against the bound %.3g\n", dropped, bound);
}

// An int8 outer all-reduce keeps a residual per rank (error feedback),
// which checkpoints leave out (each rank's differs: docs/diloco.md): the
// files hold the same outer tensors as an f32 run's, and a resume restores
// the anchor and momentum, starts the residual at zero and builds it again
// at its first outer step.
TEST_F(DiLoCoCheckpointTest, AnInt8RunResumesWithItsResidualStartedAgain) {
  ASSERT_TRUE(cluster_.ok());
  ASSERT_TRUE(cluster_.Run("int8", 4, DiLoCoFlags(kSaved, 4, 2, {"--outer_dtype=int8"})));
  const Params file = testing::LoadSafetensorsParams(Consolidate("int8"));
  const Params params = kMlp.Load(cluster_.checkpoint_root(), "int8", kSaved);
  ASSERT_FALSE(params.empty());
  EXPECT_EQ(file.size(), 3 * params.size());  // parameters, anchor, momentum
  ASSERT_TRUE(cluster_.Run("int8", 4,
                           DiLoCoFlags(kSteps, 4, 2, {"--outer_dtype=int8", "--resume=latest"})));
  EXPECT_NE(cluster_.WorkerLog(0).find("outer step 2, anchor and outer momentum"),
            std::string::npos)
      << cluster_.WorkerLog(0);
  const nlohmann::json report = cluster_.Report("int8", 0);
  ASSERT_EQ(report["outer_steps"].size(), 1u);
  EXPECT_EQ(report["outer_steps"][0]["outer_step"].get<int>(), 3);
  EXPECT_GT(report["outer_steps"][0]["residual_norm"].get<double>(), 0.0);
}

// Recovery from in-memory snapshots (docs/recovery.md) with a heartbeat
// short enough to notice a killed worker quickly.
class DiLoCoRecoveryTest : public ::testing::Test {
 protected:
  DiLoCoRecoveryTest()
      : cluster_(testing::MakeTempDir("diloco_recovery"),
                 {"--heartbeat_interval_ms=300", "--heartbeat_timeout_ms=1500"}) {}

  // Every member of `job` has committed a snapshot of step >= `step`, as the
  // server's status says: a kill that must restore from a snapshot waits
  // for this (recovery_test.cc explains why not for a step count).
  bool WaitForCommittedSnapshot(const std::string& job, int step) {
    ClientOptions options;
    options.server = cluster_.address();
    options.rpc_timeout = absl::Seconds(5);
    absl::StatusOr<std::unique_ptr<Client>> observer = Client::Connect(options);
    if (!observer.ok()) return false;
    return testing::WaitFor(
        [&] {
          absl::StatusOr<v1::GetStatusResponse> status = (*observer)->GetStatus(job);
          return status.ok() && status->jobs_size() == 1 && status->jobs(0).snapshot_step() >= step;
        },
        absl::Seconds(60));
  }

  LocalCluster cluster_;
};

// W = 4 as 2 groups of 2, H = 5, outer momentum 0.9: snapshots are taken
// right after outer steps (--snapshot_every defaults to H) and hold the
// anchor, the outer momentum and the outer step count beside the
// parameters. Rank 2 is killed mid-run and replaced; the job restores the
// snapshot from the replicas and goes on. A recovered run does the same
// arithmetic in the same order from exactly restored state, so its final
// parameters are bitwise the uninterrupted run's; had the momentum
// restarted at zero, the next outer step would have moved them by
// outer_lr x momentum^2 x the buffer (0.3 % of a tensor's scale in the
// test above), which bitwise equality rules out.
TEST_F(DiLoCoRecoveryTest, AReplacedWorkerRecoversTheOuterMomentumFromTheSnapshots) {
  ASSERT_TRUE(cluster_.ok());
  constexpr int kRunSteps = 60;
  const std::vector<std::string> diloco = {"--stage=3",
                                           "--optimizer=sgd",
                                           "--batch=2",
                                           "--shard_group_size=2",
                                           "--sync=diloco",
                                           "--outer_every=5",
                                           "--rejoin_timeout=60s",
                                           "--join_timeout_s=60"};
  ASSERT_TRUE(cluster_.Run("reference", 4, kMlp.Flags(kRunSteps, diloco)));
  std::vector<std::string> slowed = diloco;
  slowed.push_back("--test_step_delay_ms=10");  // the kill lands mid-run
  cluster_.StartWorkers("recover", 4, kMlp.Flags(kRunSteps, slowed));
  ASSERT_TRUE(
      testing::WaitFor([&] { return cluster_.WorkerLog(0).find("step 25/") != std::string::npos; },
                       absl::Seconds(60)))
      << cluster_.WorkerLog(0);
  ASSERT_TRUE(WaitForCommittedSnapshot("recover", 10)) << cluster_.WorkerLog(0);
  cluster_.worker(2)->Signal(SIGKILL);
  cluster_.RestartWorker(2);
  const std::vector<int> codes = cluster_.WaitWorkers(absl::Seconds(120));
  for (size_t r = 0; r < codes.size(); ++r) {
    ASSERT_EQ(codes[r], 0) << "worker " << r << ":\n" << cluster_.WorkerLog(r);
  }
  const nlohmann::json report = cluster_.Report("recover", 0);
  ASSERT_GE(report["recoveries"].size(), 1u) << report.dump();
  EXPECT_EQ(report["recoveries"][0]["source"], "snapshot") << report.dump();
  const int restored = report["recoveries"][0]["restored_step"];
  EXPECT_EQ(restored % 5, 0) << restored;
  EXPECT_NE(cluster_.WorkerLog(0).find(
                absl::StrCat("outer step ", restored / 5, ", anchor and outer momentum")),
            std::string::npos)
      << cluster_.WorkerLog(0);
  const Params reference = kMlp.Load(cluster_.checkpoint_root(), "reference", kRunSteps);
  const Params recovered = kMlp.Load(cluster_.checkpoint_root(), "recover", kRunSteps);
  ASSERT_FALSE(recovered.empty());
  EXPECT_TRUE(recovered == reference)
      << "not bitwise the uninterrupted run; max relative difference "
      << MaxRelativeDifference(recovered, reference);
}

}  // namespace
}  // namespace zeroshard
