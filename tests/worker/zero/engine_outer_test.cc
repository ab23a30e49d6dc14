// ZeroEngine::OuterStep (DiLoCo, engine_outer.cc) with real Gloo / shared
// memory communicators, W = 4 ranks as threads in 2 shard groups of 2 (stage
// 3, and stage 2 with bf16 parameters): two outer rounds of H = 2 Adam steps on each group's own
// rows. From each rank's master shard before and after every outer step, the test computes the
// outer step again — the replicas' mean of anchor - master, Nesterov momentum carried from round to
// round, the int8 / int4 wire's dequantized values and the residual fed into the next round — and
// checks the engine's.
#include <algorithm>
#include <cmath>
#include <map>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/plan/planner.h"
#include "gtest/gtest.h"
#include "tests/testing/error_model.h"
#include "tests/worker/zero/outer_ranks.h"
#include "worker/comm/in_memory_kv_store.h"
#include "worker/comm/quantized.h"
#include "worker/data/regression_data.h"
#include "worker/model/mlp.h"
#include "worker/zero/engine.h"

namespace zeroshard {
namespace {

using testing::kFloat32Unit;

constexpr int kWorld = 4, kGroup = 2, kRounds = 2, kEvery = 2, kBatch = 4, kWidth = 16;
constexpr double kOuterLr = 0.7, kMomentum = 0.9;

// What each rank saw: its master shard at the start (the first anchor), before
// each outer step (the group's own) and after it; each outer step's stats;
// its units' chunk sizes.
struct RankTrace {
  std::vector<float> start;
  std::vector<std::vector<float>> before, after;
  std::vector<OuterStats> stats;
  std::vector<int64_t> chunks;
  // After each outer step, the loss of one batch every rank shares, from
  // the parameters the model computes on (gathered at stage 3, the
  // replicated copy at stages 1-2): the same in both groups.
  std::vector<double> shared_loss;
};

std::vector<RankTrace> Train(OuterWire outer_dtype, int stage, DType param_dtype) {
  MlpConfig mlp{2, kWidth, "gelu"};
  auto plan = PlanOuterMlp(mlp, kWorld, kGroup);
  EXPECT_TRUE(plan.ok()) << plan.status();
  std::vector<RankTrace> traces(kWorld);
  InMemoryKvStore store;
  OnRankThreads(kWorld, [&](int rank) {
    auto comms = ConnectOuterRank(&store, rank, kWorld, kGroup);
    ASSERT_TRUE(comms.ok()) << comms.status();
    auto model = MlpModel::Create(mlp);
    ASSERT_TRUE(model.ok());
    EngineOptions options;
    options.stage = stage;
    options.param_dtype = param_dtype;
    options.collective_timeout = absl::Seconds(30);
    options.replicas = comms->replicas.get();
    options.replica_sync = ReplicaSync::kDiLoCo;
    options.outer = OuterOptions{kEvery, kOuterLr, kMomentum, outer_dtype};
    auto engine = ZeroEngine::Create(model->get(), *plan, comms->gather.get(), comms->reduce.get(),
                                     comms->aux.get(), options);
    ASSERT_TRUE(engine.ok()) << engine.status();
    ZeroEngine& e = **engine;
    ASSERT_TRUE(InitializeFromSeed(e, **model, /*seed=*/7).ok());
    RankTrace& trace = traces[rank];
    for (const UnitLayout& u : e.units()) trace.chunks.push_back(u.chunk_elements);
    trace.start = *e.CopyMasterShard();
    SyntheticRegressionData data(/*seed=*/11, kWidth);
    std::vector<float> x(kBatch * kWidth), y(kBatch * kWidth);
    for (int step = 0; step < kRounds * kEvery; ++step) {
      // Each rank its own rows: the groups' gradients differ.
      ASSERT_TRUE(data.Fill(step, 0, rank, kWorld, kBatch, 1, x.data(), y.data()).ok());
      ASSERT_TRUE((*model)->SetBatch(x.data(), y.data(), kBatch).ok());
      ASSERT_TRUE(e.ForwardBackward(true).ok());
      auto stats = e.Step(1e-2);
      ASSERT_TRUE(stats.ok()) << stats.status();
      ASSERT_TRUE(stats->verdict.finite());
      if ((step + 1) % kEvery != 0) continue;
      trace.before.push_back(*e.CopyMasterShard());
      auto outer = e.OuterStep();
      ASSERT_TRUE(outer.ok()) << outer.status();
      trace.stats.push_back(*outer);
      trace.after.push_back(*e.CopyMasterShard());
      ASSERT_TRUE(data.Fill(1000, 0, 0, 1, kBatch, 1, x.data(), y.data()).ok());
      ASSERT_TRUE((*model)->SetBatch(x.data(), y.data(), kBatch).ok());
      auto loss = e.Forward();
      ASSERT_TRUE(loss.ok()) << loss.status();
      trace.shared_loss.push_back(*loss);
    }
  });
  return traces;
}

// The wire's view of this rank's outer gradient x (whole chunks, unit by
// unit): x itself in f32; int8's or int4's dequantized blocks (what
// QuantizedAllReduce(Int4) sends), with the residual x - wire.
std::vector<float> Wire(const std::vector<float>& x, const std::vector<int64_t>& chunks,
                        OuterWire dtype) {
  if (dtype == OuterWire::kF32) return x;
  std::vector<float> wire(x.size());
  int64_t at = 0;
  for (int64_t n : chunks) {
    if (dtype == OuterWire::kInt8) {
      std::vector<char> packed(Int8PackedBytes(n));
      QuantizeInt8(x.data() + at, n, packed.data());
      DequantizeInt8(packed.data(), n, 0, n, wire.data() + at);
    } else {
      std::vector<char> packed(Int4PackedBytes(n));
      QuantizeInt4(x.data() + at, n, packed.data());
      DequantizeInt4(packed.data(), n, 0, n, wire.data() + at);
    }
    at += n;
  }
  return wire;
}

// `kept`: where the traces go, for checks of their own (null: dropped).
void CheckOuterSteps(OuterWire dtype, int stage = 3, DType param_dtype = DType::kF32,
                     std::vector<RankTrace>* kept = nullptr) {
  std::vector<RankTrace> traces = Train(dtype, stage, param_dtype);
  if (kept != nullptr) *kept = traces;
  for (int rank = 0; rank < kWorld; ++rank) {
    const int peer = (rank + kGroup) % kWorld;  // the same shard in the other group
    const RankTrace& t = traces[rank];
    const RankTrace& p = traces[peer];
    ASSERT_EQ(t.after.size(), kRounds);
    std::vector<float> anchor = t.start, residual(anchor.size(), 0), peer_residual = residual;
    std::vector<double> momentum(anchor.size(), 0);
    for (int k = 0; k < kRounds; ++k) {
      // After an outer step both groups hold the same bits.
      EXPECT_EQ(t.after[k], p.after[k]) << "rank " << rank << " round " << k;
      EXPECT_EQ(t.shared_loss[k], p.shared_loss[k]) << "rank " << rank << " round " << k;
      std::vector<float> x(anchor.size()), px(anchor.size());
      for (size_t i = 0; i < x.size(); ++i) {
        x[i] = (anchor[i] - t.before[k][i]) + residual[i];  // f32, as the engine
        px[i] = (anchor[i] - p.before[k][i]) + peer_residual[i];
      }
      const std::vector<float> wire = Wire(x, t.chunks, dtype);
      const std::vector<float> peer_wire = Wire(px, p.chunks, dtype);
      double residual_squares = 0;
      for (size_t i = 0; i < x.size() && dtype != OuterWire::kF32; ++i) {
        residual[i] = x[i] - wire[i];
        peer_residual[i] = px[i] - peer_wire[i];
        residual_squares += static_cast<double>(residual[i]) * residual[i];
      }
      // The residual kept is exactly what this rank's wire copy lost (sums
      // of squares in double, in another order: 1e-12 relative).
      EXPECT_NEAR(t.stats[k].residual_squares, residual_squares, 1e-12 * residual_squares + 1e-30);
      if (QuantizedOuterWire(dtype)) {
        EXPECT_GT(residual_squares, 0) << "round " << k;
      }
      // PyTorch's SGD(nesterov) in double: buf = momentum buf + g (g at the
      // first step), update g + momentum buf. The engine's f32 differs by
      // its roundings: the difference, the replicas' sum and halving, the
      // momentum's product and sum, the Nesterov sum, the update's product
      // and sum, each within u of the largest term in play, and the carried
      // buffer's own (k + 1 rounds): 16 u of max(|a|, lr |mean|, lr |buf|).
      double worst = 0, allowed = 0;
      for (size_t i = 0; i < x.size(); ++i) {
        const double mean = (static_cast<double>(wire[i]) + peer_wire[i]) / 2;
        momentum[i] = k == 0 ? mean : kMomentum * momentum[i] + mean;
        const double expected = anchor[i] - kOuterLr * (mean + kMomentum * momentum[i]);
        const double scale =
            std::max({std::fabs(static_cast<double>(anchor[i])), kOuterLr * std::fabs(mean),
                      kOuterLr * std::fabs(momentum[i])});
        worst = std::max(worst, std::fabs(t.after[k][i] - expected) - 16 * kFloat32Unit * scale);
        allowed = std::max(allowed, 16 * kFloat32Unit * scale);
      }
      EXPECT_LE(worst, 0) << "rank " << rank << " round " << k << ": beyond the bound (up to "
                          << allowed << ") by " << worst;
      anchor = t.after[k];
    }
    // The groups did train apart before each outer step.
    EXPECT_NE(t.before[0], p.before[0]) << rank;
  }
}

TEST(EngineOuterTest, NesterovOuterStepsOverTheReplicasInF32) { CheckOuterSteps(OuterWire::kF32); }

TEST(EngineOuterTest, Int8OuterStepsKeepAndFeedBackTheirResidual) {
  CheckOuterSteps(OuterWire::kInt8);
}

// int4: the same outer step with error feedback (checked as int8's above:
// the reference recomputes the int4 wire, so the 16 u bound is unchanged),
// and its bytes. With 2 replicas f32's ring all-reduce sends each rank's
// chunk once (half reduce-scattered, half all-gathered): 4 bytes an
// element; int4's all-gather sends this rank's packed chunk to its one
// peer: Int4PackedBytes(n) = 4 ceil(n / 64) + ceil(n / 2) to a word, i.e.
// 0.5 + 4 / 64 bytes an element, 9/64 (~0.14) of f32's, a little more on
// small chunks where the last block and word are partial.
TEST(EngineOuterTest, Int4OuterStepsFeedBackTheirResidualAndSendAbout9Of64OfF32sBytes) {
  std::vector<RankTrace> int4;
  CheckOuterSteps(OuterWire::kInt4, 3, DType::kF32, &int4);
  ASSERT_EQ(int4.size(), kWorld);
  const std::vector<RankTrace> f32 = Train(OuterWire::kF32, 3, DType::kF32);
  for (int rank = 0; rank < kWorld; ++rank) {
    int64_t packed = 0, elements = 0, partial = 0;
    for (int64_t n : int4[rank].chunks) {
      packed += Int4PackedBytes(n);
      elements += n;
      partial += 4 + 1 + 3;  // a partial block's scale, an odd byte, a word's padding
    }
    for (int k = 0; k < kRounds; ++k) {
      EXPECT_EQ(f32[rank].stats[k].bytes_sent, 4 * elements) << "rank " << rank << " round " << k;
      EXPECT_EQ(int4[rank].stats[k].bytes_sent, packed) << "rank " << rank << " round " << k;
      // 9/64 of f32's, plus at most the partial blocks' and words' bytes.
      EXPECT_LE(64 * int4[rank].stats[k].bytes_sent,
                9 * f32[rank].stats[k].bytes_sent + 64 * partial);
      EXPECT_GE(64 * int4[rank].stats[k].bytes_sent, 9 * f32[rank].stats[k].bytes_sent);
    }
  }
}

// Stage 2 with bf16 parameters: the f32 master is the shard, and the outer
// step all-gathers the new one into the replicated bf16 parameters, which
// the second round trains on.
TEST(EngineOuterTest, StageTwoWithBf16ParametersRefreshesItsReplicatedCopy) {
  CheckOuterSteps(OuterWire::kF32, 2, DType::kBF16);
}

}  // namespace
}  // namespace zeroshard
