// ZeroEngine::OuterStepAmong (elastic DiLoCo, --outer_timeout;
// engine_outer_elastic.cc): W = 4 ranks as threads in 2 shard groups of 2,
// stage 3, H = 2 Adam steps a round. In round 0 the quorum let group 0 in
// alone: it runs its own outer step (no collective) and group 1 skips it,
// training on from its old anchor. In round 1 both groups are present;
// group 1 is stale (one outer step behind) and is caught up: group 0's
// anchor, outer momentum and counts are broadcast to it, it adds zero to
// the mean and the mean is group 0's change alone. Checked: both groups
// end with the same bits, equal to the two outer Nesterov steps recomputed
// in double from group 0's master shards alone (group 1's inner progress
// dropped), and the stats say who was stale.
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

constexpr int kWorld = 4, kGroup = 2, kEvery = 2, kBatch = 4, kWidth = 16;
constexpr double kOuterLr = 0.7, kMomentum = 0.9;

struct RankTrace {
  std::vector<float> start;
  std::vector<std::vector<float>> before, after;  // per outer step taken part in
  std::vector<OuterStats> stats;
};

void TrainRank(const ShardPlan& plan, const MlpConfig& mlp, InMemoryKvStore& store, int rank,
               RankTrace& trace) {
  const int group = rank / kGroup;
  // The per-step agreement is the group's own under --outer_timeout: the
  // groups are not coupled between outer steps (group 1 skips one).
  auto comms = ConnectOuterRank(&store, rank, kWorld, kGroup, /*group_numerics=*/true);
  ASSERT_TRUE(comms.ok()) << comms.status();
  Communicator* replicas = comms->replicas.get();
  auto model = MlpModel::Create(mlp);
  ASSERT_TRUE(model.ok());
  EngineOptions options;
  options.stage = 3;
  options.collective_timeout = absl::Seconds(30);
  options.replicas = replicas;
  options.numerics = comms->numerics.get();
  options.replica_sync = ReplicaSync::kDiLoCo;
  options.outer = OuterOptions{kEvery, kOuterLr, kMomentum, OuterWire::kF32};
  auto engine = ZeroEngine::Create(model->get(), plan, comms->gather.get(), comms->reduce.get(),
                                   comms->aux.get(), options);
  ASSERT_TRUE(engine.ok()) << engine.status();
  ZeroEngine& e = **engine;
  ASSERT_TRUE(InitializeFromSeed(e, **model, /*seed=*/7).ok());
  trace.start = *e.CopyMasterShard();
  SyntheticRegressionData data(/*seed=*/11, kWidth);
  std::vector<float> x(kBatch * kWidth), y(kBatch * kWidth);
  for (int step = 0; step < 2 * kEvery; ++step) {
    ASSERT_TRUE(data.Fill(step, 0, rank, kWorld, kBatch, 1, x.data(), y.data()).ok());
    ASSERT_TRUE((*model)->SetBatch(x.data(), y.data(), kBatch).ok());
    ASSERT_TRUE(e.ForwardBackward(true).ok());
    auto stats = e.Step(1e-2);
    ASSERT_TRUE(stats.ok()) << stats.status();
    if ((step + 1) % kEvery != 0) continue;
    const int round = step / kEvery;
    if (round == 0 && group == 1) continue;  // left out: trains on
    trace.before.push_back(*e.CopyMasterShard());
    auto outer = e.OuterStepAmong(round == 0 ? nullptr : replicas);
    ASSERT_TRUE(outer.ok()) << outer.status();
    trace.stats.push_back(*outer);
    trace.after.push_back(*e.CopyMasterShard());
  }
}

std::vector<RankTrace> Train() {
  MlpConfig mlp{2, kWidth, "gelu"};
  auto plan = PlanOuterMlp(mlp, kWorld, kGroup);
  EXPECT_TRUE(plan.ok()) << plan.status();
  std::vector<RankTrace> traces(kWorld);
  InMemoryKvStore store;
  OnRankThreads(kWorld, [&](int rank) { TrainRank(*plan, mlp, store, rank, traces[rank]); });
  return traces;
}

// Error model: PyTorch's SGD(nesterov) in double from group 0's shards
// alone: g = a - m, buf = momentum buf + g (g at the first step), a' = a -
// lr (g + momentum buf). The engine's f32 differs by its roundings — the
// difference, the momentum's product and sum, the Nesterov sum, the
// update's product and sum, the carried buffer's own over two rounds —
// each within u of the largest term in play, 16 u of max(|a|, lr |g|, lr
// |buf|) as in engine_outer_test. The catch-up adds none: group 1's zero
// added to group 0's change and the mean's halving and the widening by 2
// (present / up to date) are exact in f32, and the broadcasts copy bits.
TEST(EngineOuterElasticTest, AStaleGroupIsCaughtUpFromTheUpToDateGroup) {
  const std::vector<RankTrace> traces = Train();
  for (int rank = 0; rank < kWorld; ++rank) {
    const int group = rank / kGroup;
    const RankTrace& t = traces[rank];
    const RankTrace& up = traces[rank % kGroup];  // group 0's rank with this shard
    ASSERT_EQ(t.stats.size(), group == 0 ? 2u : 1u) << "rank " << rank;
    const OuterStats& last = t.stats.back();
    EXPECT_EQ(last.outer_step, 2) << "rank " << rank;
    EXPECT_EQ(last.stale_groups, 1) << "rank " << rank;
    EXPECT_EQ(last.caught_up, group == 1) << "rank " << rank;
    EXPECT_GT(last.bytes_sent, 0) << "rank " << rank;
    if (group == 0) {
      EXPECT_EQ(t.stats[0].bytes_sent, 0) << "one group alone sends nothing";
    }
    // Identical bits in both groups after the catch-up.
    EXPECT_EQ(t.after.back(), up.after.back()) << "rank " << rank;
    // Group 1 had moved from the start on its own: its change is dropped.
    if (group == 1) {
      EXPECT_NE(t.before.back(), up.before.back()) << "rank " << rank;
    }
    std::vector<double> anchor(up.start.begin(), up.start.end()), momentum(anchor.size(), 0);
    double worst = 0, allowed = 0;
    for (int k = 0; k < 2; ++k) {
      worst = 0;
      for (size_t i = 0; i < anchor.size(); ++i) {
        const double g = anchor[i] - up.before[k][i];
        momentum[i] = k == 0 ? g : kMomentum * momentum[i] + g;
        const double next = anchor[i] - kOuterLr * (g + kMomentum * momentum[i]);
        const double scale = std::max(
            {std::fabs(anchor[i]), kOuterLr * std::fabs(g), kOuterLr * std::fabs(momentum[i])});
        worst = std::max(worst, std::fabs(up.after[k][i] - next) - 16 * kFloat32Unit * scale);
        allowed = std::max(allowed, 16 * kFloat32Unit * scale);
        anchor[i] = k == 0 ? up.after[k][i] : next;  // round 1 from the engine's own anchor
      }
      EXPECT_LE(worst, 0) << "rank " << rank << " outer step " << k << ": beyond the bound (up to "
                          << allowed << ") by " << worst;
    }
    for (size_t i = 0; i < anchor.size(); ++i) {
      ASSERT_LE(std::fabs(t.after.back()[i] - anchor[i]), allowed) << "rank " << rank << " " << i;
    }
  }
}

}  // namespace
}  // namespace zeroshard
