// ZeroEngine::OuterStep with a single shard group (docs/diloco.md, "Elastic
// outer steps": what a recovery that left one group runs): W = 2 ranks as
// threads in one group of 2, stage 3, DiLoCo with H = 2 Adam steps for two
// rounds. The outer step is the group's own outer Nesterov SGD on its own
// change — no collective (0 bytes), the mean over one group being the
// change itself — and an int8 outer dtype's residual is spent, not kept
// (nothing crosses a wire). Checked against the update recomputed in double
// from each rank's master shard before and after every outer step.
#include <algorithm>
#include <cmath>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/plan/planner.h"
#include "gtest/gtest.h"
#include "tests/testing/error_model.h"
#include "tests/worker/zero/outer_ranks.h"
#include "worker/comm/in_memory_kv_store.h"
#include "worker/data/regression_data.h"
#include "worker/model/mlp.h"
#include "worker/zero/engine.h"

namespace zeroshard {
namespace {

using testing::kFloat32Unit;

constexpr int kWorld = 2, kRounds = 2, kEvery = 2, kBatch = 4, kWidth = 16;
constexpr double kOuterLr = 0.7, kMomentum = 0.9;

struct RankTrace {
  std::vector<float> start;
  std::vector<std::vector<float>> before, after;
  std::vector<OuterStats> stats;
};

std::vector<RankTrace> Train(OuterWire outer_dtype) {
  MlpConfig mlp{2, kWidth, "gelu"};
  auto plan = PlanOuterMlp(mlp, kWorld, /*group_size=*/kWorld);  // one group: no replicas
  EXPECT_TRUE(plan.ok()) << plan.status();
  std::vector<RankTrace> traces(kWorld);
  InMemoryKvStore store;
  OnRankThreads(kWorld, [&](int rank) {
    auto comms = ConnectOuterRank(&store, rank, kWorld, /*group_size=*/kWorld);
    ASSERT_TRUE(comms.ok()) << comms.status();
    auto model = MlpModel::Create(mlp);
    ASSERT_TRUE(model.ok());
    EngineOptions options;
    options.stage = 3;
    options.collective_timeout = absl::Seconds(30);
    options.replica_sync = ReplicaSync::kDiLoCo;  // no replicas' communicator
    options.outer = OuterOptions{kEvery, kOuterLr, kMomentum, outer_dtype};
    auto engine = ZeroEngine::Create(model->get(), *plan, comms->gather.get(), comms->reduce.get(),
                                     comms->aux.get(), options);
    ASSERT_TRUE(engine.ok()) << engine.status();
    ZeroEngine& e = **engine;
    ASSERT_TRUE(InitializeFromSeed(e, **model, /*seed=*/7).ok());
    RankTrace& trace = traces[rank];
    trace.start = *e.CopyMasterShard();
    SyntheticRegressionData data(/*seed=*/11, kWidth);
    std::vector<float> x(kBatch * kWidth), y(kBatch * kWidth);
    for (int step = 0; step < kRounds * kEvery; ++step) {
      ASSERT_TRUE(data.Fill(step, 0, rank, kWorld, kBatch, 1, x.data(), y.data()).ok());
      ASSERT_TRUE((*model)->SetBatch(x.data(), y.data(), kBatch).ok());
      ASSERT_TRUE(e.ForwardBackward(true).ok());
      auto stats = e.Step(1e-2);
      ASSERT_TRUE(stats.ok()) << stats.status();
      if ((step + 1) % kEvery != 0) continue;
      trace.before.push_back(*e.CopyMasterShard());
      auto outer = e.OuterStep();
      ASSERT_TRUE(outer.ok()) << outer.status();
      trace.stats.push_back(*outer);
      trace.after.push_back(*e.CopyMasterShard());
    }
  });
  return traces;
}

// PyTorch's SGD(nesterov) in double on the group's own change g = a - m:
// buf = momentum buf + g (g at the first step), a' = a - lr (g + momentum
// buf). The engine's f32 differs by its roundings (the difference, the
// momentum's product and sum, the Nesterov sum, the update's product and
// sum, and the carried buffer's own over k + 1 rounds), each within u of the
// largest term in play: 16 u of max(|a|, lr |g|, lr |buf|), as in
// engine_outer_test.
void CheckOneGroup(OuterWire dtype) {
  const std::vector<RankTrace> traces = Train(dtype);
  for (int rank = 0; rank < kWorld; ++rank) {
    const RankTrace& t = traces[rank];
    ASSERT_EQ(t.after.size(), kRounds);
    std::vector<float> anchor = t.start;
    std::vector<double> momentum(anchor.size(), 0);
    for (int k = 0; k < kRounds; ++k) {
      EXPECT_EQ(t.stats[k].bytes_sent, 0) << "rank " << rank << " round " << k;
      EXPECT_EQ(t.stats[k].residual_squares, 0) << "rank " << rank << " round " << k;
      double worst = 0, allowed = 0, moved = 0;
      for (size_t i = 0; i < anchor.size(); ++i) {
        const double g = static_cast<double>(anchor[i]) - t.before[k][i];
        momentum[i] = k == 0 ? g : kMomentum * momentum[i] + g;
        const double expected = anchor[i] - kOuterLr * (g + kMomentum * momentum[i]);
        const double scale = std::max({std::fabs(static_cast<double>(anchor[i])),
                                       kOuterLr * std::fabs(g), kOuterLr * std::fabs(momentum[i])});
        worst = std::max(worst, std::fabs(t.after[k][i] - expected) - 16 * kFloat32Unit * scale);
        allowed = std::max(allowed, 16 * kFloat32Unit * scale);
        // Not the inner result left as it was: the outer step moved it.
        moved = std::max(moved, std::fabs(static_cast<double>(t.after[k][i]) - t.before[k][i]));
      }
      EXPECT_LE(worst, 0) << "rank " << rank << " round " << k << ": beyond the bound (up to "
                          << allowed << ") by " << worst;
      EXPECT_GT(moved, allowed) << "rank " << rank << " round " << k;
      anchor = t.after[k];
    }
  }
}

TEST(EngineOuterOneGroupTest, F32OuterStepIsTheGroupsOwnNesterovStep) {
  CheckOneGroup(OuterWire::kF32);
}

// int8: with no peer nothing is quantized; the residual stays zero, so the
// outer gradient is the exact change in every round.
TEST(EngineOuterOneGroupTest, Int8OuterStepSendsNothingAndKeepsNoResidual) {
  CheckOneGroup(OuterWire::kInt8);
}

}  // namespace
}  // namespace zeroshard
