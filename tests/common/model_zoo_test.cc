#include "common/model_zoo.h"

#include <set>
#include <string>
#include <utility>
#include <vector>

#include "gtest/gtest.h"

namespace zeroshard {
namespace {

int64_t TotalElements(const ModelSpec& spec) {
  int64_t n = 0;
  for (const TensorSpec& t : spec.tensors) n += t.Elements();
  return n;
}

TEST(MlpSpecTest, NoActivationUsesConsecutiveIndices) {
  absl::StatusOr<ModelSpec> spec = MlpSpec(3, 16, "none");
  ASSERT_TRUE(spec.ok()) << spec.status();
  ASSERT_EQ(spec->tensors.size(), 6u);
  const char* names[] = {"0.weight", "0.bias", "1.weight", "1.bias", "2.weight", "2.bias"};
  const char* units[] = {"0", "0", "1", "1", "2", "2"};
  for (int i = 0; i < 6; ++i) {
    const TensorSpec& t = spec->tensors[i];
    EXPECT_EQ(t.name, names[i]);
    EXPECT_EQ(t.unit, units[i]);
    EXPECT_EQ(t.dtype, "F32");
    EXPECT_EQ(t.shape, (i % 2 == 0 ? std::vector<int64_t>{16, 16} : std::vector<int64_t>{16}));
  }
  EXPECT_EQ(TotalElements(*spec), 3 * (16 * 16 + 16));
}

TEST(MlpSpecTest, ActivationDoublesIndices) {
  for (const char* activation : {"relu", "gelu"}) {
    absl::StatusOr<ModelSpec> spec = MlpSpec(3, 8, activation);
    ASSERT_TRUE(spec.ok()) << spec.status();
    std::vector<std::string> names, units;
    for (const TensorSpec& t : spec->tensors) {
      names.push_back(t.name);
      units.push_back(t.unit);
    }
    EXPECT_EQ(names, (std::vector<std::string>{"0.weight", "0.bias", "2.weight", "2.bias",
                                               "4.weight", "4.bias"}));
    EXPECT_EQ(units, (std::vector<std::string>{"0", "0", "2", "2", "4", "4"}));
  }
  absl::StatusOr<ModelSpec> one = MlpSpec(1, 8, "relu");
  ASSERT_TRUE(one.ok());
  ASSERT_EQ(one->tensors.size(), 2u);
  EXPECT_EQ(one->tensors[0].name, "0.weight");
}

TEST(MlpSpecTest, RejectsBadArguments) {
  EXPECT_EQ(MlpSpec(0, 8, "none").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MlpSpec(2, 0, "none").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MlpSpec(2, -4, "relu").status().code(), absl::StatusCode::kInvalidArgument);
  absl::Status bad = MlpSpec(2, 8, "tanh").status();
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.message().find("tanh"), std::string::npos) << bad;
  EXPECT_EQ(MlpSpec(2, 8, "ReLU").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(Gpt2SpecTest, Gpt2SmallHas124MParameters) {
  absl::StatusOr<ModelSpec> spec = Gpt2Spec(12, 768, 12, 50257, 1024);
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(TotalElements(*spec), 124439808);
  ASSERT_EQ(spec->tensors.size(), 2u + 12 * 12 + 2);
  std::set<std::string> names;
  for (const TensorSpec& t : spec->tensors) {
    EXPECT_TRUE(names.insert(t.name).second) << "duplicate " << t.name;
    EXPECT_EQ(t.dtype, "F32");
  }
}

// Hugging Face's parameter counts of the four releases (num_parameters(), LM
// head tied).
TEST(Gpt2PresetTest, PresetsHaveTheReleasesParameterCounts) {
  const std::vector<std::pair<std::string, int64_t>> releases = {
      {"124M", 124439808}, {"355M", 354823168}, {"774M", 774030080}, {"1.5B", 1557611200}};
  for (const auto& [name, parameters] : releases) {
    absl::StatusOr<Gpt2Shape> shape = Gpt2Preset(name);
    ASSERT_TRUE(shape.ok()) << shape.status();
    absl::StatusOr<ModelSpec> spec =
        Gpt2Spec(shape->layers, shape->d_model, shape->heads, shape->vocab, shape->context);
    ASSERT_TRUE(spec.ok()) << spec.status();
    EXPECT_EQ(TotalElements(*spec), parameters) << name;
  }
}

TEST(Gpt2PresetTest, AnUnknownPresetNamesTheKnownOnes) {
  absl::Status bad = Gpt2Preset("2B").status();
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.message().find("124M, 355M, 774M or 1.5B"), std::string::npos) << bad;
}

TEST(Gpt2SpecTest, NamesShapesAndUnits) {
  const int64_t C = 8, V = 50, T = 16;
  absl::StatusOr<ModelSpec> spec = Gpt2Spec(2, C, 2, V, T);
  ASSERT_TRUE(spec.ok()) << spec.status();
  struct Expected {
    std::string name;
    std::vector<int64_t> shape;
    std::string unit;
  };
  std::vector<Expected> expected = {{"transformer.wte.weight", {V, C}, "embed"},
                                    {"transformer.wpe.weight", {T, C}, "embed"}};
  for (int i = 0; i < 2; ++i) {
    const std::string p = "transformer.h." + std::to_string(i) + ".";
    const std::string u = "h." + std::to_string(i);
    std::vector<Expected> block = {{p + "ln_1.weight", {C}, u},
                                   {p + "ln_1.bias", {C}, u},
                                   {p + "attn.c_attn.weight", {C, 3 * C}, u},
                                   {p + "attn.c_attn.bias", {3 * C}, u},
                                   {p + "attn.c_proj.weight", {C, C}, u},
                                   {p + "attn.c_proj.bias", {C}, u},
                                   {p + "ln_2.weight", {C}, u},
                                   {p + "ln_2.bias", {C}, u},
                                   {p + "mlp.c_fc.weight", {C, 4 * C}, u},
                                   {p + "mlp.c_fc.bias", {4 * C}, u},
                                   {p + "mlp.c_proj.weight", {4 * C, C}, u},
                                   {p + "mlp.c_proj.bias", {C}, u}};
    expected.insert(expected.end(), block.begin(), block.end());
  }
  expected.push_back({"transformer.ln_f.weight", {C}, "embed"});
  expected.push_back({"transformer.ln_f.bias", {C}, "embed"});
  ASSERT_EQ(spec->tensors.size(), expected.size());
  for (size_t i = 0; i < expected.size(); ++i) {
    EXPECT_EQ(spec->tensors[i].name, expected[i].name) << i;
    EXPECT_EQ(spec->tensors[i].shape, expected[i].shape) << expected[i].name;
    EXPECT_EQ(spec->tensors[i].unit, expected[i].unit) << expected[i].name;
  }
}

TEST(Gpt2SpecTest, RejectsBadArguments) {
  absl::Status bad = Gpt2Spec(2, 10, 3, 50, 16).status();
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.message().find("heads"), std::string::npos) << bad;
  EXPECT_EQ(Gpt2Spec(0, 8, 2, 50, 16).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Gpt2Spec(2, 0, 2, 50, 16).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Gpt2Spec(2, 8, 0, 50, 16).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Gpt2Spec(2, 8, 2, -1, 16).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Gpt2Spec(2, 8, 2, 50, 0).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace zeroshard
