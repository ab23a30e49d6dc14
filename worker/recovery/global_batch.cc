#include "worker/recovery/global_batch.h"

#include <cassert>
#include <cstdint>

#include "absl/strings/str_cat.h"

namespace zeroshard {

GlobalBatchPlan PlanGlobalBatch(bool keep, int original_world, int world, int grad_accum,
                                int batch) {
  assert(world >= 1 && original_world >= 1 && grad_accum >= 1 && "sizes are positive");
  GlobalBatchPlan plan;
  plan.grad_accum = grad_accum;
  // A generation at the original size (or, were it possible, above it) is
  // the configured run.
  if (world >= original_world) return plan;
  const int64_t micro_batches = int64_t{original_world} * grad_accum;  // per step, all ranks
  const int64_t original_rows = micro_batches * batch;
  const int64_t shrunk_rows = int64_t{world} * grad_accum * batch;
  const std::string sizes = absl::StrCat(world, " of ", original_world, " ranks");
  if (!keep) {
    plan.kept = false;
    plan.note =
        absl::StrCat(sizes, ", --keep_global_batch=false: each rank keeps its ", grad_accum,
                     " micro-batch(es) of ", batch, " a step, so the global batch shrinks from ",
                     original_rows, " to ", shrunk_rows, " samples");
    return plan;
  }
  if (micro_batches % world != 0) {
    plan.kept = false;
    plan.note =
        absl::StrCat(sizes, ": the global batch cannot be kept (--keep_global_batch): a step's ",
                     micro_batches, " micro-batches (", original_world,
                     " ranks x --grad_accum=", grad_accum, ") do not split evenly over ", world,
                     " ranks; each rank keeps its ", grad_accum, " micro-batch(es) of ", batch,
                     " and the global batch shrinks from ", original_rows, " to ", shrunk_rows,
                     " samples (to keep it, choose --grad_accum and --min_world_size so that "
                     "every world size the job may shrink to divides --world_size x --grad_accum)");
    return plan;
  }
  plan.grad_accum = static_cast<int>(micro_batches / world);
  plan.note = absl::StrCat(sizes, ", --keep_global_batch: each rank accumulates ", plan.grad_accum,
                           " micro-batches of ", batch, " a step (", grad_accum, " at ",
                           original_world, " ranks): the global batch stays ", original_rows,
                           " samples, in the original order");
  return plan;
}

std::vector<int> SizesThatCannotKeepTheGlobalBatch(int original_world, int min_world,
                                                   int grad_accum) {
  std::vector<int> sizes;
  if (min_world <= 0) return sizes;  // never shrinks
  const int64_t micro_batches = int64_t{original_world} * grad_accum;
  for (int w = min_world; w < original_world; ++w) {
    if (micro_batches % w != 0) sizes.push_back(w);
  }
  return sizes;
}

}  // namespace zeroshard
