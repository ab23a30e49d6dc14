#include "common/plan/memory_estimate.h"

#include <algorithm>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/plan/stage_traits.h"
#include "nlohmann/json.hpp"

namespace zeroshard {
namespace {

constexpr int kMaxPrefetch = 1024;

// Bytes per element of a floating-point training dtype.
absl::StatusOr<int64_t> FloatBytes(absl::string_view what, const std::string& name) {
  absl::StatusOr<DType> dtype = ParseDType(name);
  if (!dtype.ok() || (*dtype != DType::kF32 && *dtype != DType::kBF16 && *dtype != DType::kF16)) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " \"", name, "\" is not a training dtype; expected F32, BF16 or F16"));
  }
  return DTypeSize(*dtype);
}

// a * b, or an error naming `what` when it overflows int64.
absl::StatusOr<int64_t> Multiply(int64_t a, int64_t b, absl::string_view what) {
  int64_t product;
  if (__builtin_mul_overflow(a, b, &product)) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " overflows int64 bytes (", a, " * ", b, ")"));
  }
  return product;
}

absl::Status CheckEstimateOptions(const ShardPlan& plan, const MemoryEstimateOptions& options) {
  if (options.prefetch < 0 || options.prefetch > kMaxPrefetch) {
    return absl::InvalidArgumentError(absl::StrCat(
        "prefetch ", options.prefetch, " is out of range; expected 0 to ", kMaxPrefetch));
  }
  if (plan.world_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("plan world size ", plan.world_size, " is invalid"));
  }
  const int h = options.secondary_shard_group_size;
  // An empty plan (a check of the options alone) has no groups to compare.
  if (h < 0 || (h > 0 && !plan.units.empty())) {
    return ShardGroups::Make(plan.world_size, plan.options.shard_group_size, h).status();
  }
  return absl::OkStatus();
}

// The plan's parameters and shard elements (into *estimate), its largest
// chunk, and with hpZ groups of `h` the secondary shard's elements.
void CountElements(const ShardPlan& plan, int h, MemoryEstimate* estimate, int64_t* largest_chunk,
                   int64_t* secondary_elements) {
  for (const ShardUnit& unit : plan.units) {
    int64_t unit_elements = 0;
    for (const TensorSpec& tensor : unit.tensors) unit_elements += tensor.Elements();
    estimate->parameters += unit_elements;
    if (h > 0) *secondary_elements += (unit_elements + h - 1) / h;
    estimate->shard_elements += unit.chunk_elements;
    *largest_chunk = std::max(*largest_chunk, unit.chunk_elements);
  }
}

}  // namespace

absl::StatusOr<MemoryEstimate> EstimateMemory(const ShardPlan& plan,
                                              const MemoryEstimateOptions& options) {
  absl::StatusOr<int64_t> p = FloatBytes("param_dtype", options.param_dtype);
  if (!p.ok()) return p.status();
  const std::string reduce_dtype =
      options.reduce_dtype.empty() ? options.param_dtype : options.reduce_dtype;
  absl::StatusOr<int64_t> g = FloatBytes("reduce_dtype", reduce_dtype);
  if (!g.ok()) return g.status();
  if (absl::Status status = CheckEstimateOptions(plan, options); !status.ok()) return status;
  const int h = options.secondary_shard_group_size;

  MemoryEstimate estimate;
  estimate.world_size = plan.world_size;
  estimate.param_dtype = options.param_dtype;
  estimate.reduce_dtype = reduce_dtype;
  estimate.prefetch = options.prefetch;
  estimate.secondary_shard_group_size = h;
  // Adam's two fp32 moments, plus an fp32 master unless the parameter is one.
  const int64_t k = options.param_dtype == "F32" ? 8 : 12;
  estimate.optimizer_bytes_per_parameter = k;

  // A shard is spread over the ranks of one shard group (all W without
  // groups): a gathered unit is G chunks, and padding is per group.
  const int64_t w = plan.options.Groups(plan.world_size).size();
  estimate.shard_group_size = static_cast<int>(w);
  int64_t largest_chunk = 0;
  int64_t secondary_elements = 0;  // hpZ: sum over units of ceil(unit / H)
  CountElements(plan, h, &estimate, &largest_chunk, &secondary_elements);
  absl::StatusOr<int64_t> largest_unit = Multiply(w, largest_chunk, "the largest gathered unit");
  if (!largest_unit.ok()) return largest_unit.status();
  estimate.largest_unit_elements = *largest_unit;

  const int64_t psi = estimate.parameters;
  const int64_t s = estimate.shard_elements;
  const int64_t units_unsharded =
      std::min<int64_t>(1 + options.prefetch, static_cast<int64_t>(plan.units.size()));
  absl::StatusOr<int64_t> window_elements =
      Multiply(units_unsharded, *largest_unit, "the stage-3 unsharded window");
  if (!window_elements.ok()) return window_elements.status();
  absl::StatusOr<int64_t> window = Multiply(*window_elements, *p, "the stage-3 unsharded window");
  if (!window.ok()) return window.status();
  // Padding elements summed over all ranks; __int128 because W * S may
  // exceed int64 for absurd plans even when each rank's bytes fit.
  const __int128 padding_all_ranks = static_cast<__int128>(w) * s - psi;

  // Which state each stage shards: StageTraits, the engine's own rules.
  for (int stage = 0; stage < 4; ++stage) {
    const StageTraits traits = StageTraits::Of(stage);
    const int64_t param_count = traits.params_sharded ? s : psi;
    const int64_t grad_count = traits.grads_sharded ? s : psi;
    const int64_t optimizer_count = traits.state_sharded ? s : psi;
    StageMemory& m = estimate.stages[stage];
    m.stage = stage;
    absl::StatusOr<int64_t> params = Multiply(param_count, *p, "parameter bytes");
    absl::StatusOr<int64_t> grads = Multiply(grad_count, *g, "gradient bytes");
    absl::StatusOr<int64_t> optimizer = Multiply(optimizer_count, k, "optimizer bytes");
    for (const auto* part : {&params, &grads, &optimizer}) {
      if (!part->ok()) return part->status();
    }
    m.parameter_bytes = *params;
    m.gradient_bytes = *grads;
    m.optimizer_bytes = *optimizer;
    m.unsharded_window_bytes = traits.params_sharded ? *window : 0;
    m.secondary_bytes = traits.params_sharded ? 4 * secondary_elements : 0;  // f32
    const int64_t sharded_bytes_per_element = (traits.state_sharded ? k : 0) +
                                              (traits.grads_sharded ? *g : 0) +
                                              (traits.params_sharded ? *p : 0);
    const __int128 padding = padding_all_ranks * sharded_bytes_per_element;
    m.padding_bytes = static_cast<int64_t>((padding + w - 1) / w);  // mean, rounded up
    const __int128 total = static_cast<__int128>(m.parameter_bytes) + m.gradient_bytes +
                           m.optimizer_bytes + m.unsharded_window_bytes + m.secondary_bytes;
    if (total > INT64_MAX) {
      return absl::InvalidArgumentError(
          absl::StrCat("stage ", stage, " total overflows int64 bytes"));
    }
    m.total_bytes = static_cast<int64_t>(total);
  }
  return estimate;
}

nlohmann::ordered_json MemoryEstimateJson(const MemoryEstimate& estimate) {
  nlohmann::ordered_json stages = nlohmann::ordered_json::array();
  for (const StageMemory& m : estimate.stages) {
    nlohmann::ordered_json stage;
    stage["stage"] = m.stage;
    stage["parameter_bytes"] = m.parameter_bytes;
    stage["gradient_bytes"] = m.gradient_bytes;
    stage["optimizer_bytes"] = m.optimizer_bytes;
    stage["unsharded_window_bytes"] = m.unsharded_window_bytes;
    stage["secondary_bytes"] = m.secondary_bytes;
    stage["padding_bytes"] = m.padding_bytes;
    stage["total_bytes"] = m.total_bytes;
    stages.push_back(std::move(stage));
  }
  nlohmann::ordered_json out;
  out["world_size"] = estimate.world_size;
  out["shard_group_size"] = estimate.shard_group_size;
  out["param_dtype"] = estimate.param_dtype;
  out["reduce_dtype"] = estimate.reduce_dtype;
  out["prefetch"] = estimate.prefetch;
  out["secondary_shard_group_size"] = estimate.secondary_shard_group_size;
  out["parameters"] = estimate.parameters;
  out["shard_elements"] = estimate.shard_elements;
  out["largest_unit_elements"] = estimate.largest_unit_elements;
  out["optimizer_bytes_per_parameter"] = estimate.optimizer_bytes_per_parameter;
  out["stages"] = std::move(stages);
  return out;
}

std::string MemoryEstimateToJson(const MemoryEstimate& estimate) {
  return MemoryEstimateJson(estimate).dump();
}

}  // namespace zeroshard
