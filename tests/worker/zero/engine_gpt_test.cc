// The ZeRO engine driving the GPT (whose LM head is tied to the token
// embedding, so one unit is used by two ops) at W = 1, on a host backend
// whose fresh allocations are filled with NaN: every stage must train to the
// same bits as stage 0, which proves the engine never reads a byte of a
// fresh buffer it did not write first. A device allocator hands back blocks
// with old contents (cudaMallocAsync's pool), so a read of an unwritten
// gradient there is silently wrong; here it is a NaN.
#include <cmath>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/plan/planner.h"
#include "gtest/gtest.h"
#include "tests/worker/zero/forwarding_backend.h"
#include "worker/comm/gloo_communicator.h"
#include "worker/comm/in_memory_kv_store.h"
#include "worker/model/gpt.h"
#include "worker/zero/backend.h"
#include "worker/zero/engine.h"

namespace zeroshard {
namespace {

// The host backend, but every allocation starts as quiet NaNs.
class PoisoningBackend : public testing::ForwardingBackend {
 public:
  std::string name() const override { return "cpu-poisoned"; }
  void* Allocate(int64_t bytes) override {
    void* p = cpu_->Allocate(bytes);
    if (p != nullptr) std::memset(p, 0xff, bytes);  // 0xffffffff is a NaN
    return p;
  }
};

GptConfig SmallGpt() {
  GptConfig config;
  config.n_layer = 2;
  config.n_head = 4;
  config.n_embd = 64;
  config.vocab = 256;
  config.n_ctx = 16;
  return config;
}

// The small GPT's parameter count (an upper bound is all the norm's error
// model needs): 2 layers of 12 * 64^2 + 13 * 64, the embeddings and ln_f.
constexpr double kParams = 2 * (12 * 64 * 64 + 13 * 64) + 256 * 64 + 16 * 64 + 2 * 64;

struct Trained {
  std::vector<double> losses;
  std::vector<double> grad_norms;
  std::map<std::string, std::vector<float>> params;
};

// `packed`: EngineOptions::packed_collectives (the device path; over a group
// of one, stages 2-3's backward then writes the gradient shard itself, each
// tensor where the plan put it in the chunk: the GPT's blocks are planned
// largest tensor first, not in the flat order).
Trained Train(int stage, int prefetch, Backend* backend, bool packed = false) {
  Trained out;
  auto model = GptModel::Create(SmallGpt());
  EXPECT_TRUE(model.ok()) << model.status();
  if (!model.ok()) return out;
  auto plan = Plan((*model)->Spec(), 1, PlanOptions());
  EXPECT_TRUE(plan.ok()) << plan.status();
  if (!plan.ok()) return out;
  InMemoryKvStore store;
  auto g = GlooCommunicator::Create(&store, 0, 1, "gather");
  auto r = GlooCommunicator::Create(&store, 0, 1, "reduce");
  auto a = GlooCommunicator::Create(&store, 0, 1, "aux");
  EXPECT_TRUE(g.ok() && r.ok() && a.ok());
  if (!g.ok() || !r.ok() || !a.ok()) return out;
  EngineOptions options;
  options.stage = stage;
  options.prefetch = prefetch;
  options.backend = backend;
  options.packed_collectives = packed;
  options.optimizer = "adam";
  auto engine = ZeroEngine::Create(model->get(), *plan, g->get(), r->get(), a->get(), options);
  EXPECT_TRUE(engine.ok()) << engine.status();
  if (!engine.ok()) return out;
  EXPECT_TRUE((*engine)
                  ->Initialize([&](const TensorSpec& t, int64_t b, int64_t e, float* rows) {
                    (*model)->InitRows(t, b, e, /*seed=*/5, rows);
                    return absl::OkStatus();
                  })
                  .ok());
  const int batch = 2, t = SmallGpt().n_ctx;
  std::vector<int32_t> tokens(batch * t), targets(batch * t);
  for (int step = 0; step < 3; ++step) {
    for (int i = 0; i < batch * t; ++i) {
      tokens[i] = (i * 37 + step * 11) % SmallGpt().vocab;
      targets[i] = (i * 53 + step * 7 + 1) % SmallGpt().vocab;
    }
    EXPECT_TRUE((*model)->SetBatch(tokens.data(), targets.data(), batch, t).ok());
    auto loss = (*engine)->ForwardBackward(/*last_micro=*/true);
    EXPECT_TRUE(loss.ok()) << loss.status();
    auto stats = (*engine)->Step(1e-3);
    EXPECT_TRUE(stats.ok()) << stats.status();
    if (!loss.ok() || !stats.ok()) return out;
    out.losses.push_back(*loss);
    out.grad_norms.push_back(stats->grad_norm);
  }
  EXPECT_TRUE((*engine)
                  ->ForEachOwnPiece([&](const ZeroEngine::PieceView& piece) {
                    std::vector<float>& all = out.params[piece.tensor->name];
                    all.resize(piece.tensor->Elements());
                    const int64_t row = piece.tensor->RowElements();
                    std::copy(piece.params, piece.params + piece.elements,
                              all.begin() + piece.row_begin * row);
                    return absl::OkStatus();
                  })
                  .ok());
  return out;
}

TEST(EngineGptTest, EveryStageReadsOnlyWhatItWroteAndMatchesStageZeroBitwise) {
  PoisoningBackend poisoned;
  // Stage 0 on plain host memory is the reference.
  const Trained want = Train(0, 1, nullptr);
  ASSERT_EQ(want.losses.size(), 3u);
  for (int stage : {0, 1, 2, 3}) {
    for (int prefetch : {0, 1}) {
      for (bool packed : {false, true}) {
        if (packed && stage == 0) continue;  // stage 0 packs nothing
        SCOPED_TRACE(
            absl::StrCat("stage ", stage, ", prefetch ", prefetch, packed ? ", packed" : ""));
        const Trained got = Train(stage, prefetch, &poisoned, packed);
        ASSERT_EQ(got.losses.size(), want.losses.size());
        for (size_t i = 0; i < want.losses.size(); ++i) {
          // At W = 1 every stage does the same arithmetic in the same order.
          EXPECT_EQ(got.losses[i], want.losses[i]) << "step " << i;
          // The norm's sum of squares is in double, grouped by unit at stage 0
          // and by shard at stages 1-3: a sum of n non-negative terms in any
          // order is within n * 2^-53 (relative) of the exact one.
          const double bound = 2.0 * kParams * std::ldexp(1.0, -53) * want.grad_norms[i];
          EXPECT_NEAR(got.grad_norms[i], want.grad_norms[i], bound) << "gradient norm, step " << i;
        }
        for (const auto& [name, values] : want.params) {
          ASSERT_EQ(got.params.at(name).size(), values.size()) << name;
          EXPECT_EQ(0, std::memcmp(got.params.at(name).data(), values.data(),
                                   values.size() * sizeof(float)))
              << name << " differs after 3 steps";
        }
      }
    }
  }
}

// Generation runs many forwards in a row: with the parameters held, each
// Forward gives the same loss as one that gathers, and enters no gather.
TEST(EngineGptTest, HeldParametersServeForwardsWithoutGathering) {
  auto model = GptModel::Create(SmallGpt());
  ASSERT_TRUE(model.ok());
  auto plan = Plan((*model)->Spec(), 1, PlanOptions());
  ASSERT_TRUE(plan.ok());
  InMemoryKvStore store;
  auto g = GlooCommunicator::Create(&store, 0, 1, "gather");
  auto r = GlooCommunicator::Create(&store, 0, 1, "reduce");
  auto a = GlooCommunicator::Create(&store, 0, 1, "aux");
  ASSERT_TRUE(g.ok() && r.ok() && a.ok());
  EngineOptions options;
  options.stage = 3;
  auto engine = ZeroEngine::Create(model->get(), *plan, g->get(), r->get(), a->get(), options);
  ASSERT_TRUE(engine.ok()) << engine.status();
  ASSERT_TRUE((*engine)
                  ->Initialize([&](const TensorSpec& t, int64_t b, int64_t e, float* rows) {
                    (*model)->InitRows(t, b, e, /*seed=*/5, rows);
                    return absl::OkStatus();
                  })
                  .ok());
  const int t = SmallGpt().n_ctx;
  std::vector<int32_t> tokens(t), targets(t);
  for (int i = 0; i < t; ++i) {
    tokens[i] = (i * 37) % SmallGpt().vocab;
    targets[i] = (i * 53 + 1) % SmallGpt().vocab;
  }
  ASSERT_TRUE((*model)->SetBatch(tokens.data(), targets.data(), 1, t).ok());
  auto gathered = (*engine)->Forward();
  ASSERT_TRUE(gathered.ok()) << gathered.status();
  ASSERT_TRUE((*engine)->HoldGatheredParameters().ok());
  const int64_t gathers = (*engine)->Collectives().gathers_entered;
  for (int i = 0; i < 3; ++i) {
    auto held = (*engine)->Forward();
    ASSERT_TRUE(held.ok()) << held.status();
    EXPECT_EQ(*held, *gathered) << "forward " << i;
  }
  EXPECT_EQ((*engine)->Collectives().gathers_entered, gathers) << "a held forward gathered";
  (*engine)->ReleaseHeldParameters();
  auto again = (*engine)->Forward();
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*again, *gathered);
  EXPECT_GT((*engine)->Collectives().gathers_entered, gathers) << "released: gathers again";
}

}  // namespace
}  // namespace zeroshard
