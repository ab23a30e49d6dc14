#include "worker/model/gpt.h"

#include <cmath>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/model_zoo.h"
#include "gtest/gtest.h"
#include "tests/worker/model/test_util.h"
#include "worker/model/model_util.h"

namespace zeroshard {
namespace {

using ::zeroshard::testing::ExpectGradientMatches;
using ::zeroshard::testing::FdOptions;
using ::zeroshard::testing::ParamStore;
using ::zeroshard::testing::RandomVector;

std::unique_ptr<GptModel> MakeGpt(const GptConfig& config) {
  auto model = GptModel::Create(config);
  EXPECT_TRUE(model.ok()) << model.status();
  return std::move(model).value();
}

std::vector<int32_t> RandomTokens(int64_t n, int vocab, uint32_t seed) {
  auto u = RandomVector(n, 0, static_cast<float>(vocab), seed);
  std::vector<int32_t> tokens(n);
  for (int64_t i = 0; i < n; ++i) tokens[i] = std::min(static_cast<int>(u[i]), vocab - 1);
  return tokens;
}

TEST(GptSpecTest, TwoLayerNamesShapesAndUnits) {
  auto model = MakeGpt({/*n_layer=*/2, /*n_head=*/2, /*n_embd=*/8, /*vocab=*/256, /*n_ctx=*/16});
  const int64_t c = 8;
  struct Want {
    std::string name;
    std::vector<int64_t> shape;
    std::string unit;
  };
  std::vector<Want> want = {{"transformer.wte.weight", {256, c}, "embed"},
                            {"transformer.wpe.weight", {16, c}, "embed"}};
  for (int i = 0; i < 2; ++i) {
    const std::string p = absl::StrCat("transformer.h.", i, ".");
    const std::string u = absl::StrCat("h.", i);
    for (const Want& w : std::vector<Want>{{p + "ln_1.weight", {c}, u},
                                           {p + "ln_1.bias", {c}, u},
                                           {p + "attn.c_attn.weight", {c, 3 * c}, u},
                                           {p + "attn.c_attn.bias", {3 * c}, u},
                                           {p + "attn.c_proj.weight", {c, c}, u},
                                           {p + "attn.c_proj.bias", {c}, u},
                                           {p + "ln_2.weight", {c}, u},
                                           {p + "ln_2.bias", {c}, u},
                                           {p + "mlp.c_fc.weight", {c, 4 * c}, u},
                                           {p + "mlp.c_fc.bias", {4 * c}, u},
                                           {p + "mlp.c_proj.weight", {4 * c, c}, u},
                                           {p + "mlp.c_proj.bias", {c}, u}}) {
      want.push_back(w);
    }
  }
  want.push_back({"transformer.ln_f.weight", {c}, "embed"});
  want.push_back({"transformer.ln_f.bias", {c}, "embed"});

  const auto& t = model->Spec().tensors;
  ASSERT_EQ(t.size(), want.size());
  for (size_t i = 0; i < t.size(); ++i) {
    EXPECT_EQ(t[i].name, want[i].name) << i;
    EXPECT_EQ(t[i].shape, want[i].shape) << want[i].name;
    EXPECT_EQ(t[i].unit, want[i].unit) << want[i].name;
    EXPECT_EQ(t[i].dtype, "F32") << want[i].name;
  }
  EXPECT_EQ(model->ForwardOps(), (std::vector<int>{0, 1, 2, 0}));
  // Unit 0 gathers wte, wpe and ln_f, in spec order.
  auto units = TensorsByUnit(model->Spec());
  ASSERT_EQ(units.size(), 3u);
  EXPECT_EQ(units[0], (std::vector<int>{0, 1, 26, 27}));
  EXPECT_EQ(units[1].size(), 12u);
  EXPECT_EQ(units[2].front(), 14);
}

// The engine plans from common/model_zoo's spec and drives this model: the two
// must list the same tensors in the same order.
void ExpectSameSpec(const ModelSpec& got, const ModelSpec& want) {
  ASSERT_EQ(got.tensors.size(), want.tensors.size());
  for (size_t i = 0; i < got.tensors.size(); ++i) {
    EXPECT_EQ(got.tensors[i].name, want.tensors[i].name) << i;
    EXPECT_EQ(got.tensors[i].shape, want.tensors[i].shape) << want.tensors[i].name;
    EXPECT_EQ(got.tensors[i].dtype, want.tensors[i].dtype) << want.tensors[i].name;
    EXPECT_EQ(got.tensors[i].unit, want.tensors[i].unit) << want.tensors[i].name;
  }
}

TEST(GptSpecTest, MatchesModelZoo) {
  auto zoo = Gpt2Spec(/*layers=*/3, /*d_model=*/12, /*heads=*/3, /*vocab=*/256, /*context=*/32);
  ASSERT_TRUE(zoo.ok()) << zoo.status();
  ExpectSameSpec(MakeGpt({3, 3, 12, 256, 32})->Spec(), *zoo);
}

TEST(GptSpecTest, CreateRejectsBadConfigs) {
  EXPECT_FALSE(GptModel::Create({2, 3, 8, 256, 16}).ok());  // 8 % 3 != 0
  EXPECT_FALSE(GptModel::Create({0, 2, 8, 256, 16}).ok());
  EXPECT_FALSE(GptModel::Create({2, 2, 8, 0, 16}).ok());
}

TEST(GptModelTest, SetBatchValidates) {
  auto model = MakeGpt({1, 2, 8, 16, 4});
  std::vector<int32_t> ok(8, 3), bad(8, 3);
  bad[5] = 16;
  EXPECT_TRUE(model->SetBatch(ok.data(), ok.data(), 2, 4).ok());
  EXPECT_FALSE(model->SetBatch(bad.data(), ok.data(), 2, 4).ok());
  EXPECT_FALSE(model->SetBatch(ok.data(), bad.data(), 2, 4).ok());
  EXPECT_FALSE(model->SetBatch(ok.data(), ok.data(), 1, 8).ok());  // t > n_ctx
}

// With all-zero parameters (and LayerNorm weights zero too) the logits are 0
// and the loss is exactly log(V).
TEST(GptModelTest, ZeroModelPredictsUniform) {
  auto model = MakeGpt({2, 2, 8, 16, 8});
  ParamStore store(*model);
  auto tokens = RandomTokens(2 * 5, 16, 1);
  ASSERT_TRUE(model->SetBatch(tokens.data(), tokens.data(), 2, 5).ok());
  // log(16) in float32 and a mean of equal terms: a few u of 2.77.
  EXPECT_NEAR(store.ForwardAll(*model), std::log(16.0), 1e-6);
  for (int64_t i = 0; i < 2 * 5 * 16; ++i) EXPECT_EQ(model->Logits()[i], 0.0f);
}

TEST(GptModelTest, LogitsRowToHostCopiesOnePosition) {
  auto model = MakeGpt({1, 2, 8, 16, 8});
  ParamStore store(*model);
  for (int i = 0; i < store.num_tensors(); ++i) {
    store.param(i) = RandomVector(store.param(i).size(), -0.4f, 0.4f, 50 + i);
  }
  auto tokens = RandomTokens(2 * 5, 16, 3);
  ASSERT_TRUE(model->SetBatch(tokens.data(), tokens.data(), 2, 5).ok());
  store.ForwardAll(*model);
  std::vector<float> row(16);
  ASSERT_TRUE(model->LogitsRowToHost(7, row.data()).ok());
  EXPECT_EQ(row, std::vector<float>(model->Logits() + 7 * 16, model->Logits() + 8 * 16));
  EXPECT_NE(row, std::vector<float>(16, 0.0f));
  EXPECT_EQ(model->LogitsRowToHost(10, row.data()).code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(model->LogitsRowToHost(-1, row.data()).code(), absl::StatusCode::kOutOfRange);
}

// Sets every parameter to a random value of a size that makes every path
// matter (the HF init's 0.02 would leave attention almost uniform and most
// gradients near zero, a weak test).
void RandomizeParams(const Model& model, ParamStore& store, uint32_t seed) {
  for (int i = 0; i < store.num_tensors(); ++i) {
    const std::string& name = model.Spec().tensors[i].name;
    const bool ln_weight =
        name.find("ln_") != std::string::npos && name.find("weight") != std::string::npos;
    auto v = ln_weight ? RandomVector(store.param(i).size(), 0.7f, 1.3f, seed + i)
                       : RandomVector(store.param(i).size(), -0.4f, 0.4f, seed + i);
    store.param(i) = v;
  }
}

TEST(GptModelTest, GradientMatchesFiniteDifferencesOfLoss) {
  const GptConfig config{/*n_layer=*/2, /*n_head=*/2, /*n_embd=*/8, /*vocab=*/16,
                         /*n_ctx=*/8};
  const int b = 2, t = 5;  // t < n_ctx: the unused wpe rows must get zero gradient
  auto model = MakeGpt(config);
  ParamStore store(*model);
  RandomizeParams(*model, store, 7);
  // Repeated tokens exercise the scatter-add of the embedding backward.
  std::vector<int32_t> tokens = {1, 3, 1, 1, 0, 4, 4, 9, 15, 2};
  std::vector<int32_t> targets = {3, 1, 1, 0, 4, 4, 9, 15, 2, 7};
  ASSERT_TRUE(model->SetBatch(tokens.data(), targets.data(), b, t).ok());
  store.ForwardAll(*model);
  ASSERT_TRUE(store.BackwardAll(*model).ok());

  FdOptions opt;
  opt.eps = 4e-3f;
  opt.atol = 3e-4;
  opt.rtol = 3e-2;
  opt.max_checks = 6;
  for (int i = 0; i < store.num_tensors(); ++i) {
    const TensorSpec& spec = model->Spec().tensors[i];
    const std::vector<float> grad = store.grad(i);
    opt.pick_seed = 1000 + i;
    ExpectGradientMatches([&] { return store.ForwardAll(*model); }, store.param(i).data(),
                          grad.data(), grad.size(), opt, spec.name);
    if (spec.name == "transformer.wte.weight") {
      // Every wte row feeds the LM head, so even never-seen tokens have a
      // gradient there: check rows of tokens absent from the input too.
      FdOptions row = opt;
      row.max_checks = 0;
      ExpectGradientMatches(
          [&] { return store.ForwardAll(*model); }, store.param(i).data() + 5 * config.n_embd,
          grad.data() + 5 * config.n_embd, config.n_embd, row, "wte row 5 (unused token)");
    }
    if (spec.name == "transformer.wpe.weight") {
      for (int64_t k = t * config.n_embd; k < config.n_ctx * config.n_embd; ++k) {
        EXPECT_EQ(grad[k], 0.0f) << "wpe beyond t, element " << k;
      }
    }
  }
}

// The logits at position t do not depend on tokens after t.
TEST(GptModelTest, IsCausal) {
  const GptConfig config{2, 2, 8, 16, 8};
  const int b = 1, t = 6;
  auto model = MakeGpt(config);
  ParamStore store(*model);
  RandomizeParams(*model, store, 3);
  auto tokens = RandomTokens(t, 16, 5);
  ASSERT_TRUE(model->SetBatch(tokens.data(), tokens.data(), b, t).ok());
  store.ForwardAll(*model);
  std::vector<float> before(model->Logits(), model->Logits() + t * 16);
  const int cut = 2;
  for (int i = cut + 1; i < t; ++i) tokens[i] = (tokens[i] + 7) % 16;
  ASSERT_TRUE(model->SetBatch(tokens.data(), tokens.data(), b, t).ok());
  store.ForwardAll(*model);
  for (int i = 0; i < t * 16; ++i) {
    if (i / 16 <= cut) {
      EXPECT_EQ(model->Logits()[i], before[i]) << "position " << i / 16;
    }
  }
  EXPECT_NE(std::vector<float>(model->Logits() + (t - 1) * 16, model->Logits() + t * 16),
            std::vector<float>(before.begin() + (t - 1) * 16, before.end()));
}

TEST(GptModelTest, TrainingStepsReduceLoss) {
  // A few SGD steps on one batch: the loss must go down (an end-to-end sanity
  // check that the gradient points downhill through all ops).
  const GptConfig config{2, 2, 16, 32, 16};
  auto model = MakeGpt(config);
  ParamStore store(*model);
  store.InitFromModel(1);
  auto tokens = RandomTokens(4 * 12, 32, 9);
  auto targets = RandomTokens(4 * 12, 32, 10);
  ASSERT_TRUE(model->SetBatch(tokens.data(), targets.data(), 4, 12).ok());
  const double first = store.ForwardAll(*model);
  EXPECT_NEAR(first, std::log(32.0), 0.1);  // small init: near-uniform predictions
  double loss = first;
  for (int step = 0; step < 30; ++step) {
    ASSERT_TRUE(store.BackwardAll(*model).ok());
    for (int i = 0; i < store.num_tensors(); ++i) {
      for (size_t k = 0; k < store.param(i).size(); ++k) {
        store.param(i)[k] -= 0.5f * store.grad(i)[k];
      }
    }
    loss = store.ForwardAll(*model);
  }
  EXPECT_LT(loss, first - 0.5);
}

TEST(GptModelTest, InitRowsFollowsHuggingFace) {
  const GptConfig config{4, 2, 64, 256, 32};
  auto model = MakeGpt(config);
  const float proj_std = 0.02f / std::sqrt(8.0f);
  for (const TensorSpec& t : model->Spec().tensors) {
    const int64_t rows = t.shape[0];
    const int64_t row_elems = t.Elements() / rows;
    std::vector<float> whole(t.Elements()), parts(t.Elements());
    model->InitRows(t, 0, rows, 77, whole.data());
    const int64_t mid = rows / 3;
    model->InitRows(t, 0, mid, 77, parts.data());
    model->InitRows(t, mid, rows, 77, parts.data() + mid * row_elems);
    EXPECT_EQ(whole, parts) << t.name;

    const bool is_bias = t.name.size() > 5 && t.name.substr(t.name.size() - 5) == ".bias";
    const bool is_ln = t.name.find("ln_") != std::string::npos;
    if (is_bias) {
      EXPECT_EQ(whole, std::vector<float>(whole.size(), 0.0f)) << t.name;
      continue;
    }
    if (is_ln) {
      EXPECT_EQ(whole, std::vector<float>(whole.size(), 1.0f)) << t.name;
      continue;
    }
    double sum = 0, sq = 0;
    for (float v : whole) {
      sum += v;
      sq += double{v} * v;
    }
    const double mean = sum / whole.size();
    const double stddev = std::sqrt(sq / whole.size() - mean * mean);
    const bool is_proj = t.name.find("c_proj.weight") != std::string::npos;
    const double want = is_proj ? proj_std : 0.02;
    EXPECT_NEAR(mean, 0.0, 4 * want / std::sqrt(double(whole.size()))) << t.name;
    EXPECT_NEAR(stddev, want, 0.06 * want) << t.name;
  }
}

}  // namespace
}  // namespace zeroshard
