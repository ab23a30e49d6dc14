// What planner.cc and plan_check.cc share: a validated tensor's sizes and
// the checks both the planner and the plan validation run. Internal to
// //common/plan.
#ifndef ZEROSHARD_COMMON_PLAN_PLANNER_INTERNAL_H_
#define ZEROSHARD_COMMON_PLAN_PLANNER_INTERNAL_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/plan/planner.h"

namespace zeroshard::planner_internal {

// A validated tensor's sizes. elements = rows * row_elements; bytes =
// elements * dtype size; all fit in int64.
struct TensorSize {
  int64_t rows = 0;
  int64_t row_elements = 0;
  int64_t elements = 0;
  int64_t bytes = 0;
};

// "tensor 3 (\"h.0.attn.c_attn.weight\")": how messages name a tensor.
std::string Describe(size_t index, const TensorSpec& tensor);

// INVALID_ARGUMENT unless 1 <= world_size <= kMaxWorldSize.
absl::Status CheckWorldSize(int world_size);

// Checks every tensor of `spec` and returns their sizes, in spec order.
absl::StatusOr<std::vector<TensorSize>> MeasureTensors(const ModelSpec& spec);

}  // namespace zeroshard::planner_internal

#endif  // ZEROSHARD_COMMON_PLAN_PLANNER_INTERNAL_H_
