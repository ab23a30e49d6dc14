// DiLoCo (--sync=diloco, docs/diloco.md) with real server and worker
// processes on loopback, W = 4 as 2 shard groups of 2:
//  - with one inner step per outer step, plain SGD inside and outside and
//    the outer step's lr 1, DiLoCo is every-step HSDP: the same parameters
//    within the roundings the outer step adds;
//  - with Adam inside for H = 3 steps and Nesterov outside, each group
//    trains as an independent 2-rank job on the group's rows would, and the
//    outer step is DiLoCo's, computed here in double from those jobs'
//    parameters;
//  - bad flags are refused before joining, naming what to set;
//  - an int8 (and a bf16) outer all-reduce trains, sends about a quarter
//    (half) of f32's bytes and keeps a residual (error feedback).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/safetensors.h"
#include "gtest/gtest.h"
#include "tests/testing/cluster.h"
#include "tests/testing/error_model.h"
#include "tests/testing/params.h"
#include "tests/testing/process.h"
#include "tests/testing/small_mlp.h"
#include "worker/data/regression_data.h"

namespace zeroshard {
namespace {

using testing::ExpectWithinBound;
using testing::kFloat32Unit;
using testing::LocalCluster;
using testing::MaxRelativeDifference;
using testing::Params;

const testing::SmallMlp kMlp;  // 3 x 32, GELU, lr 0.01, seed 3

std::vector<std::string> With(std::vector<std::string> flags,
                              const std::vector<std::string>& more) {
  flags.insert(flags.end(), more.begin(), more.end());
  return flags;
}

class DiLoCoTest : public ::testing::Test {
 protected:
  DiLoCoTest() : cluster_(testing::MakeTempDir("diloco")) {}
  LocalCluster cluster_;
};

// DiLoCo with H = 1, inner SGD without momentum at lr, outer SGD at lr 1
// without momentum, f32: per step each group g takes m_g = a - lr g_g from
// the anchor a (g_g: the group's gradient, the same reduce-scatter HSDP
// runs), the outer step averages d_g = a - m_g over the groups and sets
// a' = a - mean(d_g) = a - lr mean(g_g): HSDP's step, whose gradient is the
// same mean of the groups' reduce-scattered gradients. Error model: the
// gradients are summed in the same order; what differs is DiLoCo's extra
// roundings per step and element: m_g (u|m|), d_g (u|d|), the mean (u|d|)
// and a' (u|a'|), against HSDP's update (u|lr g| + u|a'|): at most
// 4 u max|p| per step with |d| << |p|. As error_model.h's steps add, each
// step's difference also feeds the next gradient to the same first order
// (lr 0.01: lr times the gradient's Lipschitz constant well below 1): a
// factor 2 per step. Relative to each tensor's max|p|: 2 T 4 u.
TEST_F(DiLoCoTest, OneInnerStepPerOuterStepIsEveryStepHsdp) {
  ASSERT_TRUE(cluster_.ok());
  constexpr int kSteps = 5;
  const std::vector<std::string> sgd = {"--optimizer=sgd", "--batch=2", "--shard_group_size=2"};
  const std::vector<std::string> diloco = {"--sync=diloco", "--outer_every=1", "--outer_lr=1",
                                           "--outer_momentum=0", "--outer_dtype=f32"};
  // Stages 1-2 refresh the replicated parameters from the anchor (an
  // all-gather in the group), stage 3 the master shard.
  for (int stage : {1, 2, 3}) {
    const std::string s = absl::StrCat("--stage=", stage);
    const std::string hsdp_job = absl::StrCat("hsdp-", stage);
    const std::string diloco_job = absl::StrCat("diloco-", stage);
    ASSERT_TRUE(cluster_.Run(hsdp_job, 4, kMlp.Flags(kSteps, With(sgd, {s}))));
    ASSERT_TRUE(cluster_.Run(diloco_job, 4, kMlp.Flags(kSteps, With(With(sgd, diloco), {s}))));
    const Params hsdp = kMlp.Load(cluster_.checkpoint_root(), hsdp_job, kSteps);
    const Params outer = kMlp.Load(cluster_.checkpoint_root(), diloco_job, kSteps);
    ExpectWithinBound(MaxRelativeDifference(outer, hsdp), 2.0 * kSteps * 4.0 * kFloat32Unit,
                      absl::StrCat("DiLoCo H=1 against every-step HSDP, stage ", stage));
    const nlohmann::json report = cluster_.Report(diloco_job, 0);
    ASSERT_EQ(report["outer_steps"].size(), kSteps);
    for (int i = 0; i < kSteps; ++i) {
      EXPECT_EQ(report["outer_steps"][i]["after_step"].get<int>(), i + 1);
      EXPECT_GT(report["outer_steps"][i]["bytes_sent"].get<int64_t>(), 0);
      EXPECT_EQ(report["outer_steps"][i]["residual_norm"].get<double>(), 0.0);  // f32: none
    }
    EXPECT_NE(cluster_.WorkerLog(0).find("outer step 5 after step 5"), std::string::npos);
  }
}

// Rows of SyntheticRegressionData(7, width): `groups` files, file g holding
// the rows a W = 4, batch-b job gives group g (ranks 2g, 2g + 1) at every
// step, in the order a 2-rank job with batch b reads them; and the file of
// all rows in the 4-rank job's order.
struct GroupData {
  std::string all;
  std::vector<std::string> group;
};

void WriteRows(const std::string& path, const std::vector<float>& x, const std::vector<float>& y,
               int64_t width) {
  const int64_t rows = static_cast<int64_t>(x.size()) / width;
  auto writer = SafetensorsWriter::Create(
      path, {{"x", DType::kF32, {rows, width}}, {"y", DType::kF32, {rows, width}}});
  ASSERT_TRUE(writer.ok()) << writer.status();
  ASSERT_TRUE((*writer)->Append(x.data(), x.size() * sizeof(float)).ok());
  ASSERT_TRUE((*writer)->Append(y.data(), y.size() * sizeof(float)).ok());
  ASSERT_TRUE((*writer)->Finish().ok());
}

GroupData WriteGroupData(const std::string& dir, int steps, int batch, int64_t width) {
  const SyntheticRegressionData synthetic(/*seed=*/7, width);
  const int64_t rows = int64_t{4} * batch * steps;
  std::vector<float> x(rows * width), y(rows * width);
  EXPECT_TRUE(synthetic.FillRows(0, rows, x.data(), y.data()).ok());
  GroupData out{dir + "/all.safetensors", {}};
  WriteRows(out.all, x, y, width);
  // Step s of the 4-rank job: rows (4 s + r) b, rank r; group g's ranks are
  // 2g and 2g + 1, so its rows of step s are [(4 s + 2 g) b, (4 s + 2 g + 2) b).
  for (int g = 0; g < 2; ++g) {
    std::vector<float> gx, gy;
    for (int s = 0; s < steps; ++s) {
      const int64_t begin = (int64_t{4} * s + 2 * g) * batch * width;
      gx.insert(gx.end(), x.begin() + begin, x.begin() + begin + 2 * batch * width);
      gy.insert(gy.end(), y.begin() + begin, y.begin() + begin + 2 * batch * width);
    }
    out.group.push_back(absl::StrCat(dir, "/group", g, ".safetensors"));
    WriteRows(out.group.back(), gx, gy, width);
  }
  return out;
}

double MaxAbs(const std::vector<float>& v) {
  double m = 0;
  for (float x : v) m = std::max(m, std::fabs(static_cast<double>(x)));
  return m;
}

// H = 3 steps of Adam (clipped at the group's own norm) in each group, then
// one outer Nesterov step. Reference: each group as an independent 2-rank
// job from the same initial parameters on the group's rows (P_g), and the
// outer step in double: SGD(lr, momentum, nesterov) from a zero momentum
// buffer takes buf = d, d + momentum buf, so
//   a' = a - lr (1 + momentum) (a - (P_0 + P_1) / 2).
// Error model: a group's inner run and its reference run the same sums on
// the same rows (the 2 ranks' gradients are added in the group's
// reduce-scatter as in the 2-rank job's), but under other plans (the chunks
// of groups of a 4-rank plan), so we allow them error_model.h's Adam bound
// (another summation order), and the outer step scales that by
// c = lr (1 + momentum); its f32 roundings (a - m, the mean, the momentum's
// product and sum, the update) add at most 6 u (max|a| + c max|a - P|).
TEST_F(DiLoCoTest, AdamGroupsAndANesterovOuterStepMatchIndependentGroupJobs) {
  ASSERT_TRUE(cluster_.ok());
  constexpr int kSteps = 3, kBatch = 4;
  constexpr double kOuterLr = 0.7, kMomentum = 0.9;
  const GroupData data = WriteGroupData(cluster_.dir(), kSteps, kBatch, kMlp.width);
  const std::vector<std::string> common = {"--stage=3", absl::StrCat("--batch=", kBatch),
                                           "--max_grad_norm=0.5"};
  ASSERT_TRUE(cluster_.Run("init", 1, kMlp.Flags(0, With(common, {"--data=" + data.all}))));
  for (int g = 0; g < 2; ++g) {
    ASSERT_TRUE(cluster_.Run(absl::StrCat("group", g), 2,
                             kMlp.Flags(kSteps, With(common, {"--data=" + data.group[g]}))));
  }
  ASSERT_TRUE(cluster_.Run(
      "diloco", 4,
      kMlp.Flags(kSteps, With(common, {"--data=" + data.all, "--shard_group_size=2",
                                       "--sync=diloco", absl::StrCat("--outer_every=", kSteps),
                                       absl::StrCat("--outer_lr=", kOuterLr),
                                       absl::StrCat("--outer_momentum=", kMomentum)}))));
  const Params init = kMlp.Load(cluster_.checkpoint_root(), "init", 0);
  const Params p0 = kMlp.Load(cluster_.checkpoint_root(), "group0", kSteps);
  const Params p1 = kMlp.Load(cluster_.checkpoint_root(), "group1", kSteps);
  const Params got = kMlp.Load(cluster_.checkpoint_root(), "diloco", kSteps);
  ASSERT_EQ(got.size(), init.size());
  const double c = kOuterLr * (1 + kMomentum);
  const double inner = kMlp.Bound(kSteps, 2 * kBatch, p0);
  for (const auto& [name, a] : init) {
    std::vector<float> expected(a.size()), mean(a.size()), change(a.size());
    for (size_t i = 0; i < a.size(); ++i) {
      const double m = (static_cast<double>(p0.at(name)[i]) + p1.at(name)[i]) / 2;
      mean[i] = static_cast<float>(m);
      change[i] = static_cast<float>(a[i] - m);
      expected[i] = static_cast<float>(a[i] - c * (a[i] - m));
    }
    double diff = 0;
    for (size_t i = 0; i < a.size(); ++i) {
      diff = std::max(diff, std::fabs(static_cast<double>(got.at(name)[i]) - expected[i]));
    }
    const double bound = c * inner * MaxAbs(mean) +
                         6 * kFloat32Unit * (MaxAbs(a) + c * MaxAbs(change)) +
                         kFloat32Unit * MaxAbs(expected);  // expected's own rounding to f32
    ExpectWithinBound(diff, bound, "DiLoCo H=3 Adam + Nesterov against group jobs: " + name);
    // Not two equal inputs: the groups moved apart, and the outer step
    // (lr 0.7 x 1.9 of the change) lands away from the plain mean of the
    // groups, each by more than the bound.
    double apart = 0, from_mean = 0;
    for (size_t i = 0; i < a.size(); ++i) {
      apart = std::max(apart, std::fabs(static_cast<double>(p0.at(name)[i]) - p1.at(name)[i]));
      from_mean = std::max(from_mean, std::fabs(static_cast<double>(expected[i]) - mean[i]));
    }
    EXPECT_GT(apart, bound) << name;
    EXPECT_GT(from_mean, bound) << name;
  }
  const nlohmann::json report = cluster_.Report("diloco", 0);
  ASSERT_EQ(report["outer_steps"].size(), 1u);
  EXPECT_EQ(report["outer_steps"][0]["after_step"].get<int>(), kSteps);
}

// A DiLoCo job checkpoints only right after an outer step, where every
// group holds the anchor: its checkpoint is one model. Without state on
// either side (inner SGD and outer SGD without momentum) a run stopped and
// resumed at an outer step is bitwise the uninterrupted one: the same sums
// on the same rows. (With outer momentum: diloco_checkpoint_test.)
TEST_F(DiLoCoTest, ACheckpointAtAnOuterStepResumesTheRun) {
  ASSERT_TRUE(cluster_.ok());
  constexpr int kSteps = 4;
  const std::vector<std::string> flags = {
      "--stage=3",     "--batch=2",       "--optimizer=sgd",    "--shard_group_size=2",
      "--sync=diloco", "--outer_every=2", "--outer_momentum=0", "--checkpoint_every=2"};
  ASSERT_TRUE(cluster_.Run("uninterrupted", 4, kMlp.Flags(kSteps, flags)));
  ASSERT_TRUE(cluster_.Run("resumed", 4, kMlp.Flags(2, flags)));
  ASSERT_TRUE(cluster_.Run("resumed", 4, kMlp.Flags(kSteps, With(flags, {"--resume=latest"}))));
  const Params uninterrupted = kMlp.Load(cluster_.checkpoint_root(), "uninterrupted", kSteps);
  EXPECT_EQ(kMlp.Load(cluster_.checkpoint_root(), "resumed", kSteps), uninterrupted);
  EXPECT_NE(kMlp.Load(cluster_.checkpoint_root(), "resumed", 2), uninterrupted);
  const nlohmann::json report = cluster_.Report("resumed", 0);
  ASSERT_EQ(report["outer_steps"].size(), 1u);  // this process's: after step 4
  EXPECT_EQ(report["outer_steps"][0]["after_step"].get<int>(), kSteps);
}

// Bad combinations are refused before the worker joins (exit 2), naming
// the flag and what to set.
TEST(DiLoCoFlagsTest, BadFlagsAreRefusedNamingWhatToSet) {
  struct Case {
    std::vector<std::string> flags;
    std::string expected;
  };
  const std::vector<Case> cases = {
      {{"--sync=diloco"}, "set --shard_group_size=G"},
      {{"--sync=diloco", "--shard_group_size=4"}, "this job has one group"},
      {{"--sync=sometimes", "--shard_group_size=2"}, "--sync=sometimes: expected every_step or"},
      {{"--outer_every=5", "--shard_group_size=2"}, "--outer_every sets DiLoCo's outer step"},
      {{"--sync=diloco", "--shard_group_size=2", "--outer_every=0"}, "--outer_every=0: expected"},
      {{"--sync=diloco", "--shard_group_size=2", "--outer_lr=0"}, "--outer_lr=0: expected"},
      {{"--sync=diloco", "--shard_group_size=2", "--outer_momentum=1"},
       "--outer_momentum=1: expected a Nesterov momentum in [0, 1)"},
      {{"--sync=diloco", "--shard_group_size=2", "--outer_dtype=fp8"},
       "--outer_dtype=fp8: expected f32, bf16, int8 or int4"},
      {{"--sync=diloco", "--shard_group_size=2", "--outer_every=4", "--checkpoint_dir=/tmp",
        "--checkpoint_every=6"},
       "use a multiple of --outer_every"},
      {{"--sync=diloco", "--shard_group_size=2", "--outer_every=4", "--snapshot_every=6"},
       "use 0 or a multiple of --outer_every"},
      {{"--sync=diloco", "--shard_group_size=2", "--replica_check_every=2"},
       "drop --replica_check_every"},
  };
  const std::string worker = testing::RunfilePath("worker/shard_worker");
  for (const Case& c : cases) {
    const std::string command =
        absl::StrCat(worker, " --job=flags --world_size=4 --server=127.0.0.1:1 ",
                     absl::StrJoin(c.flags, " "), " 2>&1");
    auto [code, output] = testing::RunCommand(command);
    EXPECT_EQ(code, 2) << command << "\n" << output;
    EXPECT_TRUE(absl::StrContains(output, c.expected))
        << command << ": no '" << c.expected << "' in\n"
        << output;
  }
}

// int8 and int4 outer all-reduces (--outer_dtype=int8, int4) with Adam
// inside, H = 2: the loss goes down and stays finite, each outer step sends
// about a quarter (int8: values and one f32 scale per 256) or an eighth
// (int4: nibbles and one f32 scale per 64) of f32's bytes (against f32's
// ring; all with 2 replicas), and every outer step keeps a residual (what the
// int8 copy lost, added to the next outer gradient): error feedback. An
// f32 DiLoCo run sends 1/H of every-step HSDP's bytes between the groups.
TEST_F(DiLoCoTest, Int8AndInt4OuterStepsTrainWithErrorFeedback) {
  ASSERT_TRUE(cluster_.ok());
  constexpr int kSteps = 12, kEvery = 2;
  auto flags = [&](const std::string& dtype) {
    return kMlp.Flags(kSteps, {"--stage=3", "--batch=4", "--shard_group_size=2", "--sync=diloco",
                               absl::StrCat("--outer_every=", kEvery), "--outer_dtype=" + dtype});
  };
  ASSERT_TRUE(cluster_.Run("int8", 4, flags("int8")));
  ASSERT_TRUE(cluster_.Run("int4", 4, flags("int4")));
  ASSERT_TRUE(cluster_.Run("bf16", 4, flags("bf16")));
  ASSERT_TRUE(cluster_.Run("f32", 4, flags("f32")));
  // Every-step HSDP on the same job: its replicas' all-reduce each step.
  ASSERT_TRUE(cluster_.Run("hsdp", 4,
                           kMlp.Flags(kSteps, {"--stage=3", "--batch=4", "--shard_group_size=2"})));
  const nlohmann::json int8 = cluster_.Report("int8", 0);
  const nlohmann::json int4 = cluster_.Report("int4", 0);
  const nlohmann::json bf16 = cluster_.Report("bf16", 0);
  const nlohmann::json f32 = cluster_.Report("f32", 0);
  const std::vector<double> losses = int8["losses"];
  ASSERT_EQ(losses.size(), kSteps);
  for (double loss : losses) EXPECT_TRUE(std::isfinite(loss));
  EXPECT_LT(losses.back(), losses.front());
  ASSERT_EQ(int8["outer_steps"].size(), kSteps / kEvery);
  ASSERT_EQ(int4["outer_steps"].size(), kSteps / kEvery);
  const std::vector<double> int4_losses = int4["losses"];
  ASSERT_EQ(int4_losses.size(), kSteps);
  for (double loss : int4_losses) EXPECT_TRUE(std::isfinite(loss));
  EXPECT_LT(int4_losses.back(), int4_losses.front());
  ASSERT_EQ(f32["outer_steps"].size(), kSteps / kEvery);
  ASSERT_EQ(bf16["outer_steps"].size(), kSteps / kEvery);
  // Stage 3's only all-reduce is the replicas': DiLoCo's are the outer
  // steps' alone (no per-step average), each the size of one step's of
  // HSDP (one f32 chunk per unit over the same 2 replicas): 1/H of them.
  int64_t outer_bytes = 0;
  for (const nlohmann::json& o : f32["outer_steps"]) outer_bytes += o["bytes_sent"].get<int64_t>();
  EXPECT_EQ(f32["comm_bytes"]["all_reduce"].get<int64_t>(), outer_bytes);
  const nlohmann::json hsdp = cluster_.Report("hsdp", 0);
  EXPECT_EQ(hsdp["comm_bytes"]["all_reduce"].get<int64_t>(), kEvery * outer_bytes);
  for (size_t i = 0; i < int8["outer_steps"].size(); ++i) {
    const nlohmann::json& q = int8["outer_steps"][i];
    EXPECT_GT(q["residual_norm"].get<double>(), 0.0) << i;
    EXPECT_TRUE(std::isfinite(q["outer_grad_norm"].get<double>())) << i;
    // bf16 keeps a residual too, and sends half of f32's bytes.
    const nlohmann::json& half = bf16["outer_steps"][i];
    EXPECT_GT(half["residual_norm"].get<double>(), 0.0) << i;
    EXPECT_EQ(2 * half["bytes_sent"].get<int64_t>(),
              f32["outer_steps"][i]["bytes_sent"].get<int64_t>())
        << i;
    // 1 + 4/256 bytes an element against 4: below a third.
    EXPECT_LT(3 * q["bytes_sent"].get<int64_t>(),
              f32["outer_steps"][i]["bytes_sent"].get<int64_t>())
        << i;
    // int4: a residual too, and 0.5 + 4/64 bytes an element against 4:
    // 9/64 (~0.14, above 1/8), plus at most 8 bytes a unit's chunk (a
    // partial block's scale, an odd byte, a word's padding), on chunks of
    // hundreds of elements here (3 x 32 over 2 shards): below 1/6.
    const nlohmann::json& four = int4["outer_steps"][i];
    EXPECT_GT(four["residual_norm"].get<double>(), 0.0) << i;
    EXPECT_TRUE(std::isfinite(four["outer_grad_norm"].get<double>())) << i;
    EXPECT_GT(8 * four["bytes_sent"].get<int64_t>(),
              f32["outer_steps"][i]["bytes_sent"].get<int64_t>())
        << i;
    EXPECT_LT(6 * four["bytes_sent"].get<int64_t>(),
              f32["outer_steps"][i]["bytes_sent"].get<int64_t>())
        << i;
  }
}

}  // namespace
}  // namespace zeroshard
