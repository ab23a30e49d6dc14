#include "common/plan/memory_estimate.h"

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "common/plan/planner.h"

namespace zeroshard {
namespace {

TensorSpec Tensor(std::string name, std::vector<int64_t> shape, std::string unit) {
  TensorSpec t;
  t.name = std::move(name);
  t.shape = std::move(shape);
  t.unit = std::move(unit);
  return t;
}

// Two units of four [64, 16] tensors: at W = 4 with alignment 1 every rank
// holds exactly one tensor per unit, so the plan has no padding and
// S = psi / W.
ShardPlan PaddingFreePlan() {
  ModelSpec spec;
  for (int u = 0; u < 2; ++u) {
    for (int i = 0; i < 4; ++i) {
      spec.tensors.push_back(Tensor(absl::StrCat("u", u, ".w", i), {64, 16}, absl::StrCat("u", u)));
    }
  }
  PlanOptions options;
  options.alignment_elements = 1;
  absl::StatusOr<ShardPlan> plan = Plan(spec, 4, options);
  EXPECT_TRUE(plan.ok()) << plan.status();
  return *plan;
}

MemoryEstimate Estimate(const ShardPlan& plan, const std::string& param, const std::string& reduce,
                        int prefetch) {
  MemoryEstimateOptions options;
  options.param_dtype = param;
  options.reduce_dtype = reduce;
  options.prefetch = prefetch;
  absl::StatusOr<MemoryEstimate> estimate = EstimateMemory(plan, options);
  EXPECT_TRUE(estimate.ok()) << estimate.status();
  return *estimate;
}

TEST(MemoryEstimate, Fp32MatchesTheClosedFormOnAPaddingFreePlan) {
  const ShardPlan plan = PaddingFreePlan();
  const MemoryEstimate m = Estimate(plan, "F32", "", 1);
  const int64_t psi = 8 * 64 * 16, w = 4;
  ASSERT_EQ(m.parameters, psi);
  ASSERT_EQ(m.shard_elements, psi / w);
  EXPECT_EQ(m.reduce_dtype, "F32");
  EXPECT_EQ(m.optimizer_bytes_per_parameter, 8);
  // Window: 1 + prefetch = 2 units of W * chunk = 4,096 elements, 4 bytes.
  const int64_t window = 2 * 4096 * 4;
  EXPECT_EQ(m.stages[0].total_bytes, 16 * psi);
  EXPECT_EQ(m.stages[1].total_bytes, 8 * psi + 8 * psi / w);
  EXPECT_EQ(m.stages[2].total_bytes, 4 * psi + 12 * psi / w);
  EXPECT_EQ(m.stages[3].total_bytes, 16 * psi / w + window);
  EXPECT_EQ(m.stages[3].unsharded_window_bytes, window);
  for (const StageMemory& s : m.stages) EXPECT_EQ(s.padding_bytes, 0) << "stage " << s.stage;
}

TEST(MemoryEstimate, Bf16MixedPrecisionMatchesTheZeroPaper) {
  const ShardPlan plan = PaddingFreePlan();
  const MemoryEstimate m = Estimate(plan, "BF16", "BF16", 0);
  const int64_t psi = 8 * 64 * 16, w = 4;
  EXPECT_EQ(m.optimizer_bytes_per_parameter, 12);
  const int64_t window = 1 * 4096 * 2;  // prefetch 0: one unit, BF16
  EXPECT_EQ(m.stages[0].total_bytes, (2 + 2 + 12) * psi);
  EXPECT_EQ(m.stages[1].total_bytes, 4 * psi + 12 * psi / w);
  EXPECT_EQ(m.stages[2].total_bytes, 2 * psi + 14 * psi / w);
  EXPECT_EQ(m.stages[3].total_bytes, 16 * psi / w + window);
  // The parts: stage 2 keeps BF16 params replicated, shards grads and Adam.
  EXPECT_EQ(m.stages[2].parameter_bytes, 2 * psi);
  EXPECT_EQ(m.stages[2].gradient_bytes, 2 * psi / w);
  EXPECT_EQ(m.stages[2].optimizer_bytes, 12 * psi / w);
}

TEST(MemoryEstimate, MixedReduceDtypeCountsGradientsInIt) {
  const MemoryEstimate m = Estimate(PaddingFreePlan(), "BF16", "F32", 1);
  const int64_t psi = 8 * 64 * 16;
  EXPECT_EQ(m.stages[0].gradient_bytes, 4 * psi);
  EXPECT_EQ(m.stages[0].parameter_bytes, 2 * psi);
}

TEST(MemoryEstimate, ShardedStateIncludesThePlansPadding) {
  // 1,000 elements over 3 ranks, alignment 64: chunk 384, S = 384 > 1000 / 3.
  ModelSpec spec{{Tensor("w", {1000}, "")}};
  absl::StatusOr<ShardPlan> plan = Plan(spec, 3, PlanOptions());
  ASSERT_TRUE(plan.ok()) << plan.status();
  const MemoryEstimate m = Estimate(*plan, "F32", "F32", 1);
  ASSERT_EQ(m.shard_elements, 384);
  EXPECT_EQ(m.stages[3].parameter_bytes + m.stages[3].gradient_bytes + m.stages[3].optimizer_bytes,
            16 * 384);
  // Padding over all ranks: 3 * 384 - 1000 = 152 elements; mean per rank
  // ceil(152 / 3 * 16) bytes at stage 3, ceil(152 / 3 * 8) at stage 1.
  EXPECT_EQ(m.stages[3].padding_bytes, (152 * 16 + 2) / 3);
  EXPECT_EQ(m.stages[1].padding_bytes, (152 * 8 + 2) / 3);
  EXPECT_EQ(m.stages[0].padding_bytes, 0);
  // One unit only: the window cannot hold more than it.
  EXPECT_EQ(m.stages[3].unsharded_window_bytes, 3 * 384 * 4);
}

// hpZ at W = 4 with secondary groups of 2: each rank keeps half of every
// unit (4 tensors of 64 x 16) in f32 at stage 3, and nothing at stages 0-2.
TEST(MemoryEstimate, SecondaryShardsAddHalfTheModelAtStageThreeWithGroupsOfTwo) {
  const ShardPlan plan = PaddingFreePlan();
  MemoryEstimateOptions options;
  options.secondary_shard_group_size = 2;
  absl::StatusOr<MemoryEstimate> m = EstimateMemory(plan, options);
  ASSERT_TRUE(m.ok()) << m.status();
  const int64_t psi = 8 * 64 * 16;
  EXPECT_EQ(m->stages[3].secondary_bytes, 4 * psi / 2);
  EXPECT_EQ(m->stages[3].total_bytes, 16 * psi / 4 + m->stages[3].unsharded_window_bytes +
                                          4 * psi / 2);
  EXPECT_EQ(m->stages[2].secondary_bytes, 0);
  EXPECT_EQ(nlohmann::json::parse(MemoryEstimateToJson(*m))["secondary_shard_group_size"], 2);
  // Groups that do not divide W, or as large as the shard groups (W here).
  for (int h : {3, 4, -1}) {
    options.secondary_shard_group_size = h;
    EXPECT_EQ(EstimateMemory(plan, options).status().code(), absl::StatusCode::kInvalidArgument)
        << h;
  }
}

TEST(MemoryEstimate, RefusesUnsupportedDtypesAndPrefetch) {
  const ShardPlan plan = PaddingFreePlan();
  MemoryEstimateOptions options;
  options.param_dtype = "I8";
  EXPECT_EQ(EstimateMemory(plan, options).status().code(), absl::StatusCode::kInvalidArgument);
  options.param_dtype = "F32";
  options.reduce_dtype = "fp8";
  absl::Status status = EstimateMemory(plan, options).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()), ::testing::HasSubstr("fp8"));
  options.reduce_dtype = "";
  options.prefetch = -1;
  EXPECT_EQ(EstimateMemory(plan, options).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(MemoryEstimate, JsonHasEveryStageAndField) {
  const MemoryEstimate m = Estimate(PaddingFreePlan(), "BF16", "", 2);
  const nlohmann::json json = nlohmann::json::parse(MemoryEstimateToJson(m));
  EXPECT_EQ(json["world_size"], 4);
  EXPECT_EQ(json["param_dtype"], "BF16");
  EXPECT_EQ(json["reduce_dtype"], "BF16");
  EXPECT_EQ(json["prefetch"], 2);
  EXPECT_EQ(json["parameters"], m.parameters);
  ASSERT_EQ(json["stages"].size(), 4u);
  for (int s = 0; s < 4; ++s) {
    const nlohmann::json& stage = json["stages"][s];
    EXPECT_EQ(stage["stage"], s);
    EXPECT_EQ(stage["total_bytes"], m.stages[s].total_bytes);
    EXPECT_EQ(stage["parameter_bytes"], m.stages[s].parameter_bytes);
    EXPECT_EQ(stage["gradient_bytes"], m.stages[s].gradient_bytes);
    EXPECT_EQ(stage["optimizer_bytes"], m.stages[s].optimizer_bytes);
    EXPECT_EQ(stage["unsharded_window_bytes"], m.stages[s].unsharded_window_bytes);
    EXPECT_EQ(stage["padding_bytes"], m.stages[s].padding_bytes);
  }
}

}  // namespace
}  // namespace zeroshard
