#include "common/plan/plan_codec.h"

#include <string>
#include <tuple>
#include <vector>

#include "common/model_zoo.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "common/plan/planner.h"

namespace zeroshard {
namespace {

ModelSpec SmallGpt2() {
  absl::StatusOr<ModelSpec> spec = Gpt2Spec(2, 64, 4, 500, 32);
  EXPECT_TRUE(spec.ok()) << spec.status();
  return *spec;
}

void ExpectSameTensor(const TensorSpec& a, const TensorSpec& b) {
  EXPECT_EQ(a.name, b.name);
  EXPECT_EQ(a.shape, b.shape);
  EXPECT_EQ(a.dtype, b.dtype);
  EXPECT_EQ(a.unit, b.unit);
}

TEST(PlanCodec, ModelSpecRoundTripsThroughTheWire) {
  ModelSpec spec = SmallGpt2();
  TensorSpec scalar;
  scalar.name = "scale";  // 0-d, unlabeled, BF16
  scalar.dtype = "BF16";
  spec.tensors.push_back(scalar);

  std::string wire;
  ASSERT_TRUE(ModelSpecToProto(spec).SerializeToString(&wire));
  v1::ModelSpec parsed;
  ASSERT_TRUE(parsed.ParseFromString(wire));
  const ModelSpec back = ModelSpecFromProto(parsed);
  ASSERT_EQ(back.tensors.size(), spec.tensors.size());
  for (size_t i = 0; i < spec.tensors.size(); ++i)
    ExpectSameTensor(back.tensors[i], spec.tensors[i]);
}

TEST(PlanCodec, PlanOptionsRoundTrip) {
  PlanOptions options;
  options.max_unit_bytes = 12345;
  options.alignment_elements = 7;
  options.split_fraction = 0.125;
  const PlanOptions back = PlanOptionsFromProto(PlanOptionsToProto(options));
  EXPECT_EQ(back.max_unit_bytes, 12345);
  EXPECT_EQ(back.alignment_elements, 7);
  EXPECT_EQ(back.split_fraction, 0.125);
}

TEST(PlanCodec, ShardPlanRoundTripsAndStillValidates) {
  const ModelSpec spec = SmallGpt2();
  absl::StatusOr<ShardPlan> plan = Plan(spec, 8, PlanOptions());
  ASSERT_TRUE(plan.ok()) << plan.status();

  std::string wire;
  ASSERT_TRUE(ShardPlanToProto(*plan).SerializeToString(&wire));
  v1::ShardPlan parsed;
  ASSERT_TRUE(parsed.ParseFromString(wire));
  const ShardPlan back = ShardPlanFromProto(parsed);

  EXPECT_EQ(back.version, plan->version);
  EXPECT_EQ(back.world_size, 8);
  EXPECT_EQ(back.hash, plan->hash);
  EXPECT_EQ(back.options.max_unit_bytes, plan->options.max_unit_bytes);
  EXPECT_EQ(back.options.alignment_elements, plan->options.alignment_elements);
  EXPECT_EQ(back.options.split_fraction, plan->options.split_fraction);
  ASSERT_EQ(back.units.size(), plan->units.size());
  for (size_t u = 0; u < back.units.size(); ++u) {
    const ShardUnit& a = back.units[u];
    const ShardUnit& b = plan->units[u];
    EXPECT_EQ(a.name, b.name);
    EXPECT_EQ(a.chunk_elements, b.chunk_elements);
    ASSERT_EQ(a.tensors.size(), b.tensors.size());
    for (size_t t = 0; t < a.tensors.size(); ++t) ExpectSameTensor(a.tensors[t], b.tensors[t]);
    ASSERT_EQ(a.pieces.size(), b.pieces.size());
    for (size_t i = 0; i < a.pieces.size(); ++i) {
      const Piece& x = a.pieces[i];
      const Piece& y = b.pieces[i];
      EXPECT_EQ(std::tie(x.tensor, x.row_begin, x.row_end, x.rank, x.offset),
                std::tie(y.tensor, y.row_begin, y.row_end, y.rank, y.offset));
    }
  }
  EXPECT_TRUE(ValidatePlan(spec, back).ok()) << ValidatePlan(spec, back);
  EXPECT_EQ(PlanHash(back), plan->hash);
}

TEST(PlanCodec, PaddingOverheadIsAllocatedOverElementsMinusOne) {
  ShardPlan plan;
  plan.world_size = 4;
  ShardUnit unit;
  TensorSpec t;
  t.name = "w";
  t.shape = {10, 10};  // 100 elements in chunks of 32 on 4 ranks: 128
  unit.tensors.push_back(t);
  unit.chunk_elements = 32;
  plan.units.push_back(unit);
  EXPECT_DOUBLE_EQ(PaddingOverhead(plan), 0.28);
  EXPECT_EQ(PaddingOverhead(ShardPlan()), 0);
}

TEST(PlanCodec, JsonNamesTensorsAndCarriesEveryPiece) {
  const ModelSpec spec = SmallGpt2();
  absl::StatusOr<ShardPlan> plan = Plan(spec, 4, PlanOptions());
  ASSERT_TRUE(plan.ok()) << plan.status();
  const std::string text = PlanToJson(*plan);
  // Keys in the documented order.
  EXPECT_EQ(
      text.rfind("{\"world_size\":4,\"shard_group_size\":4,\"plan_hash\":\"" + plan->hash +
                     "\",\"padding_overhead\":",
                 0),
      0u)
      << text.substr(0, 80);
  const nlohmann::json json = nlohmann::json::parse(text);
  EXPECT_DOUBLE_EQ(json["padding_overhead"].get<double>(), PaddingOverhead(*plan));
  ASSERT_EQ(json["units"].size(), plan->units.size());
  for (size_t u = 0; u < plan->units.size(); ++u) {
    const ShardUnit& unit = plan->units[u];
    const nlohmann::json& ju = json["units"][u];
    EXPECT_EQ(ju["name"], unit.name);
    EXPECT_EQ(ju["chunk_elements"], unit.chunk_elements);
    ASSERT_EQ(ju["pieces"].size(), unit.pieces.size());
    for (size_t i = 0; i < unit.pieces.size(); ++i) {
      const nlohmann::json& jp = ju["pieces"][i];
      const Piece& p = unit.pieces[i];
      EXPECT_EQ(jp["tensor"], unit.tensors[p.tensor].name);
      EXPECT_EQ(jp["row_begin"], p.row_begin);
      EXPECT_EQ(jp["row_end"], p.row_end);
      EXPECT_EQ(jp["rank"], p.rank);
      EXPECT_EQ(jp["offset"], p.offset);
    }
  }
}

TEST(PlanCodec, JsonAppendsExtraFieldsAndEscapesNames) {
  ModelSpec spec;
  TensorSpec t;
  t.name = "odd \"name\"\\ with\ttab";
  t.shape = {4, 2};
  t.unit = "unit \"u\"";
  spec.tensors.push_back(t);
  absl::StatusOr<ShardPlan> plan = Plan(spec, 2, PlanOptions());
  ASSERT_TRUE(plan.ok()) << plan.status();
  nlohmann::ordered_json extra;
  extra["memory_estimate"] = {{"world_size", 2}};
  const nlohmann::json json = nlohmann::json::parse(PlanToJson(*plan, extra));
  EXPECT_EQ(json["units"][0]["name"], t.unit);
  EXPECT_EQ(json["units"][0]["pieces"][0]["tensor"], t.name);
  EXPECT_EQ(json["memory_estimate"]["world_size"], 2);
  EXPECT_EQ(nlohmann::json::parse(PlanToJson(*plan)).count("memory_estimate"), 0u);
}

}  // namespace
}  // namespace zeroshard
