// The model spec JSON (shard_worker --spec, shardctl plan) and the planner
// behind it: any bytes give a spec or an error; an accepted spec either
// plans, and the plan passes ValidatePlan, or is refused with an error.
// The first byte picks the world size (1..256).
#include <cstdint>
#include <cstdlib>

#include "absl/strings/string_view.h"
#include "common/model_spec.h"
#include "common/plan/planner.h"

namespace {

// Plans of specs with more pieces than this are not computed here: the
// planner is O(pieces log W), and a fuzz execution must stay fast. The spec's
// own bound (kMaxTotalElements) is what the server relies on.
constexpr int64_t kMaxPlannedElements = int64_t{1} << 26;

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const int world_size = 1 + data[0];
  absl::string_view json(reinterpret_cast<const char*>(data + 1), size - 1);
  absl::StatusOr<zeroshard::ModelSpec> spec = zeroshard::ParseModelSpecJson(json);
  if (!spec.ok()) return 0;
  absl::StatusOr<zeroshard::ModelSpec> again =
      zeroshard::ParseModelSpecJson(zeroshard::ModelSpecToJson(*spec));
  if (!again.ok() || again->tensors.size() != spec->tensors.size()) std::abort();
  int64_t elements = 0;
  for (const zeroshard::TensorSpec& t : spec->tensors) {
    for (int64_t d : t.shape) {
      if (d <= 0 || d > kMaxPlannedElements) return 0;
    }
    const int64_t e = t.Elements();
    if (e <= 0 || e > kMaxPlannedElements - elements) return 0;
    elements += e;
  }
  absl::StatusOr<zeroshard::ShardPlan> plan =
      zeroshard::Plan(*spec, world_size, zeroshard::PlanOptions());
  if (plan.ok() && !zeroshard::ValidatePlan(*spec, *plan).ok()) std::abort();
  return 0;
}
