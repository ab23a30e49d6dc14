// Streaming DiLoCo in ZeroEngine (BeginOuterFragment / FinishOuterFragment,
// engine_outer_stream.cc) with real Gloo / shared-memory communicators, W = 4
// ranks as threads in 2 shard groups of 2, stage 3, a 3-layer MLP (3 units):
//  - more fragments than units are refused at Create;
//  - both paths, bitwise: one fragment begun and finished at once (mix 0)
//    is OuterStep; so are 3 fragments begun and finished one after another
//    (f32, bf16 and int8 outer dtypes);
//  - F = 2 fragments, H = 2 (one fragment every step), delay τ = 1, mix 0.5:
//    every fragment's outer step recomputed from the ranks' master shards at
//    its begin and just before its finish (one inner step later), the
//    Nesterov momentum carried per unit, and the merge
//    anchor' + mix (local - anchor'); the units outside the fragment are left
//    as the inner step made them; the all-reduce ran on the replica thread.
#include <algorithm>
#include <cmath>
#include <functional>
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

constexpr int kWorld = 4, kGroup = 2, kBatch = 4, kWidth = 16, kLayers = 3;
constexpr double kOuterLr = 0.7, kMomentum = 0.9;

// Runs `body(rank, engine, model)` on W threads, each with its own engine
// made with `outer`.
// With `create_errors`, Create's failures are collected there (by rank)
// instead of failing the test.
void OnRanks(const OuterOptions& outer,
             const std::function<void(int, ZeroEngine&, MlpModel&)>& body,
             std::vector<absl::Status>* create_errors = nullptr) {
  MlpConfig mlp{kLayers, kWidth, "gelu"};
  auto plan = PlanOuterMlp(mlp, kWorld, kGroup);
  ASSERT_TRUE(plan.ok()) << plan.status();
  InMemoryKvStore store;
  OnRankThreads(kWorld, [&](int rank) {
    auto comms = ConnectOuterRank(&store, rank, kWorld, kGroup);
    ASSERT_TRUE(comms.ok()) << comms.status();
    auto model = MlpModel::Create(mlp);
    ASSERT_TRUE(model.ok());
    EngineOptions options;
    options.stage = 3;
    options.collective_timeout = absl::Seconds(30);
    options.replicas = comms->replicas.get();
    options.replica_sync = ReplicaSync::kDiLoCo;
    options.outer = outer;
    auto engine = ZeroEngine::Create(model->get(), *plan, comms->gather.get(), comms->reduce.get(),
                                     comms->aux.get(), options);
    if (create_errors != nullptr) {
      (*create_errors)[rank] = engine.status();
      return;
    }
    ASSERT_TRUE(engine.ok()) << engine.status();
    ASSERT_TRUE(InitializeFromSeed(**engine, **model, /*seed=*/7).ok());
    body(rank, **engine, **model);
  });
}

// One inner step on this rank's own rows of `step` (the groups' differ).
void InnerStep(int rank, int step, ZeroEngine& e, MlpModel& m) {
  SyntheticRegressionData data(/*seed=*/11, kWidth);
  std::vector<float> x(kBatch * kWidth), y(kBatch * kWidth);
  ASSERT_TRUE(data.Fill(step, 0, rank, kWorld, kBatch, 1, x.data(), y.data()).ok());
  ASSERT_TRUE(m.SetBatch(x.data(), y.data(), kBatch).ok());
  ASSERT_TRUE(e.ForwardBackward(true).ok());
  auto stats = e.Step(1e-2);
  ASSERT_TRUE(stats.ok()) << stats.status();
  ASSERT_TRUE(stats->verdict.finite());
}

OuterOptions Outer(int fragments, int delay, double mix, OuterWire wire = OuterWire::kF32) {
  OuterOptions o{/*every=*/2, kOuterLr, kMomentum, wire};
  o.fragments = fragments;
  o.delay = delay;
  o.mix = mix;
  return o;
}

// Each rank's master shard after each of 2 rounds of H = 2 inner steps and
// an outer step, taken by `sync`.
using Shards = std::vector<std::vector<std::vector<float>>>;  // [rank][round]
Shards TwoRounds(const OuterOptions& outer,
                 const std::function<void(ZeroEngine&, std::vector<int64_t>*)>& sync,
                 std::vector<std::vector<int64_t>>* bytes) {
  Shards shards(kWorld);
  bytes->assign(kWorld, {});
  OnRanks(outer, [&](int rank, ZeroEngine& e, MlpModel& m) {
    for (int step = 0; step < 4; ++step) {
      InnerStep(rank, step, e, m);
      if (step % 2 == 0) continue;
      sync(e, &(*bytes)[rank]);
      shards[rank].push_back(*e.CopyMasterShard());
    }
  });
  return shards;
}

void CheckFragmentPathsAreOuterStep(OuterWire dtype) {
  std::vector<std::vector<int64_t>> full_bytes, one_bytes, three_bytes;
  const Shards full = TwoRounds(
      Outer(1, 0, 0.5, dtype),
      [](ZeroEngine& e, std::vector<int64_t>* bytes) {
        auto s = e.OuterStep();
        ASSERT_TRUE(s.ok()) << s.status();
        bytes->push_back(s->bytes_sent);
      },
      &full_bytes);
  // Fragments begun and finished with no inner step between: mix 0 applies
  // the outer result as OuterStep does, unit by unit in the same order.
  auto fragments = [](ZeroEngine& e, std::vector<int64_t>* bytes) {
    ASSERT_EQ(e.outer_fragments() == 1 ? 1 : 3, e.outer_fragments());
    int64_t sent = 0;
    for (int p = 0; p < e.outer_fragments(); ++p) {
      ASSERT_TRUE(e.BeginOuterFragment(p, 0).ok());
      auto s = e.FinishOuterFragment();
      ASSERT_TRUE(s.ok()) << s.status();
      EXPECT_EQ(s->fragment, p);
      EXPECT_TRUE(s->on_replica_thread);
      sent += s->bytes_sent;
    }
    bytes->push_back(sent);
  };
  const Shards one = TwoRounds(Outer(1, 1, 0, dtype), fragments, &one_bytes);
  const Shards three = TwoRounds(Outer(3, 1, 0, dtype), fragments, &three_bytes);
  for (int rank = 0; rank < kWorld; ++rank) {
    ASSERT_EQ(full[rank].size(), 2u);
    EXPECT_EQ(one[rank], full[rank]) << rank;
    EXPECT_EQ(three[rank], full[rank]) << rank;
    // The same all-reduces (one per unit), split over the fragments.
    EXPECT_EQ(one_bytes[rank], full_bytes[rank]) << rank;
    EXPECT_EQ(three_bytes[rank], full_bytes[rank]) << rank;
  }
  // And both groups hold the same bits.
  EXPECT_EQ(three[0], three[2]);
}

TEST(EngineOuterStreamTest, FragmentPathsAreOuterStepBitwise) {
  CheckFragmentPathsAreOuterStep(OuterWire::kF32);
}

// bf16's wire copy in the fragment's buffer and int8's and int4's quantized
// all-reduces on the replica thread, with their residuals: the same bits too.
TEST(EngineOuterStreamTest, Bf16Int8AndInt4FragmentPathsAreOuterStepBitwise) {
  CheckFragmentPathsAreOuterStep(OuterWire::kBF16);
  CheckFragmentPathsAreOuterStep(OuterWire::kInt8);
  CheckFragmentPathsAreOuterStep(OuterWire::kInt4);
}

// What a rank saw around one fragment's outer step.
struct FragmentTrace {
  int fragment = -1;
  std::vector<float> at_begin, before_finish, after_finish;
  OuterStats stats;
};

TEST(EngineOuterStreamTest, DelayedFragmentsMergeTheOuterResultWithTheLocalParameters) {
  constexpr int kSteps = 6, kDelay = 1;
  constexpr double kMix = 0.5;
  std::vector<std::vector<FragmentTrace>> traces(kWorld);
  std::vector<std::vector<float>> start(kWorld);
  std::vector<std::vector<int64_t>> chunks(kWorld);
  std::vector<std::vector<int>> fragment_of(kWorld);
  OnRanks(Outer(2, kDelay, kMix), [&](int rank, ZeroEngine& e, MlpModel& m) {
    ASSERT_EQ(e.units().size(), static_cast<size_t>(kLayers));
    ASSERT_EQ(e.outer_fragments(), 2);
    for (const UnitLayout& u : e.units()) chunks[rank].push_back(u.chunk_elements);
    for (int p = 0; p < 2; ++p) {
      for (int u = e.OuterFragmentUnits(p).first; u < e.OuterFragmentUnits(p).second; ++u) {
        fragment_of[rank].push_back(p);
      }
    }
    start[rank] = *e.CopyMasterShard();
    // H = 2, F = 2: one fragment begins after every step, alternating; each
    // is finished one step later, before the next begins.
    for (int step = 1; step <= kSteps; ++step) {
      InnerStep(rank, step - 1, e, m);
      if (step > 1) {
        FragmentTrace& t = traces[rank].back();
        t.before_finish = *e.CopyMasterShard();
        auto s = e.FinishOuterFragment();
        ASSERT_TRUE(s.ok()) << s.status();
        t.stats = *s;
        t.after_finish = *e.CopyMasterShard();
      }
      if (step == kSteps) break;
      FragmentTrace t;
      t.fragment = (step - 1) % 2;
      t.at_begin = *e.CopyMasterShard();
      ASSERT_TRUE(e.BeginOuterFragment(t.fragment, step).ok());
      EXPECT_EQ(e.pending_outer_fragment(), t.fragment);
      // One at a time.
      EXPECT_EQ(e.BeginOuterFragment(1 - t.fragment, step).code(),
                absl::StatusCode::kFailedPrecondition);
      EXPECT_EQ(e.OuterStep().status().code(), absl::StatusCode::kFailedPrecondition);
      traces[rank].push_back(std::move(t));
    }
  });
  for (int rank = 0; rank < kWorld; ++rank) {
    const int peer = (rank + kGroup) % kWorld;  // the same shard in the other group
    ASSERT_EQ(fragment_of[rank], (std::vector<int>{0, 1, 1}))
        << "3 equal units: the cut nearest half the parameters is after the first or second; "
           "the first of the nearest is kept";
    std::vector<double> anchor(start[rank].begin(), start[rank].end());
    std::vector<double> momentum(anchor.size(), 0);
    std::vector<int> synced(kLayers, 0);
    for (size_t k = 0; k < traces[rank].size(); ++k) {
      const FragmentTrace& t = traces[rank][k];
      const FragmentTrace& p = traces[peer][k];
      ASSERT_EQ(t.stats.fragment, t.fragment);
      EXPECT_EQ(t.stats.began_tag, static_cast<int64_t>(k) + 1);
      EXPECT_TRUE(t.stats.on_replica_thread) << "the outer all-reduce ran on the compute thread";
      EXPECT_GT(t.stats.bytes_sent, 0);
      // The step between begin and finish moved every unit.
      EXPECT_NE(t.before_finish, t.at_begin);
      int64_t at = 0;
      double worst = 0, allowed = 0;
      for (int u = 0; u < kLayers; ++u) {
        const int64_t n = chunks[rank][u];
        for (int64_t i = at; i < at + n; ++i) {
          if (fragment_of[rank][u] != t.fragment) {
            // Not this fragment: as the inner step left it.
            ASSERT_EQ(t.after_finish[i], t.before_finish[i]) << "unit " << u;
            continue;
          }
          // The outer gradient as of the begin, averaged over the groups;
          // Nesterov from this unit's own buffer; the merge with the local
          // parameters one step later, all in double. Error model: each
          // outer step's own roundings are OuterStep's 16 u of the terms in
          // play (engine_outer_test.cc), carried into the merge with a
          // factor (1 - mix) < 1, plus the merge's (the difference, its
          // product with mix, the sum): 4 u of max(|local|, |anchor'|); 20 u
          // of the largest in all. The engine's anchor and momentum (the
          // same bits in both groups) carry the earlier outer steps' errors
          // e into this one: the mean moves by e_a, the buffer by
          // mu e_buf + e_a, the anchor by (1 - lr (1 + mu)) e_a -
          // lr mu^2 e_buf, |1 - 0.7 * 1.9| = 0.33 and 0.7 * 0.81 = 0.57:
          // each earlier step adds at most about 2 x 20 u: 20 u (1 + 2 r) at
          // this unit's r-th outer step.
          const double x = anchor[i] - t.at_begin[i];
          const double px = anchor[i] - p.at_begin[i];
          const double mean = (x + px) / 2;
          momentum[i] = synced[u] == 0 ? mean : kMomentum * momentum[i] + mean;
          const double outer = anchor[i] - kOuterLr * (mean + kMomentum * momentum[i]);
          const double local = t.before_finish[i];
          const double expected = outer + kMix * (local - outer);
          const double scale =
              (1 + 2 * synced[u]) *
              std::max({std::fabs(anchor[i]), kOuterLr * std::fabs(mean),
                        kOuterLr * std::fabs(momentum[i]), std::fabs(local), std::fabs(outer)});
          worst =
              std::max(worst, std::fabs(t.after_finish[i] - expected) - 20 * kFloat32Unit * scale);
          allowed = std::max(allowed, 20 * kFloat32Unit * scale);
          anchor[i] = outer;  // the next outer gradient's origin, not the merge
        }
        if (fragment_of[rank][u] == t.fragment) ++synced[u];
        at += n;
      }
      EXPECT_LE(worst, 0) << "rank " << rank << " fragment step " << k
                          << ": beyond the bound (up to " << allowed << ") by " << worst;
    }
    // Fragment 0 (begun after steps 1, 3, 5) had three outer steps, fragment 1
    // (after 2 and 4) two: the momentum was carried from one to the next.
    EXPECT_EQ(synced, (std::vector<int>{3, 2, 2})) << rank;
    // With mix > 0 the groups keep part of their own progress: apart.
    EXPECT_NE(traces[rank].back().after_finish, traces[peer].back().after_finish) << rank;
  }
}

// A fragment is whole units: more fragments than units is refused at
// Create, naming the flag and the most it can be.
TEST(EngineOuterStreamTest, MoreFragmentsThanUnitsAreRefused) {
  std::vector<absl::Status> errors(kWorld);
  OnRanks(
      Outer(4, 1, 0.5), [](int, ZeroEngine&, MlpModel&) {}, &errors);
  for (const absl::Status& s : errors) {
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find("--outer_fragments=4: a fragment is one or more whole units and "
                               "this model has 3: use --outer_fragments=3 or fewer"),
              std::string::npos)
        << s;
  }
}

}  // namespace
}  // namespace zeroshard
