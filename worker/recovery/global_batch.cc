#include "worker/recovery/global_batch.h"

#include <cassert>
#include <cstdint>

#include "absl/strings/str_cat.h"

namespace zeroshard {
namespace {

// "rank 0", "ranks 1-2".
std::string Ranks(int first, int last) {
  return first == last ? absl::StrCat("rank ", first) : absl::StrCat("ranks ", first, "-", last);
}

}  // namespace

GlobalBatchPlan PlanGlobalBatch(bool keep, int original_world, int world, int grad_accum,
                                int batch) {
  assert(world >= 1 && original_world >= 1 && grad_accum >= 1 && "sizes are positive");
  GlobalBatchPlan plan;
  plan.layout = BatchLayout{world, world, grad_accum};
  // A generation at the original size (or, were it possible, above it) is
  // the configured run.
  if (world >= original_world) return plan;
  const int64_t micro_batches = int64_t{original_world} * grad_accum;  // per step, all ranks
  const int64_t original_rows = micro_batches * batch;
  const std::string sizes = absl::StrCat(world, " of ", original_world, " ranks");
  if (!keep) {
    plan.kept = false;
    plan.note =
        absl::StrCat(sizes, ", --keep_global_batch=false: each rank keeps its ", grad_accum,
                     " micro-batch(es) of ", batch, " a step, so the global batch shrinks from ",
                     original_rows, " to ", int64_t{world} * grad_accum * batch, " samples");
    return plan;
  }
  plan.layout.data_world = original_world;
  const BatchLayout& layout = plan.layout;
  const std::string kept =
      absl::StrCat("the global batch stays ", original_rows, " samples, in the original order");
  if (layout.Even()) {
    plan.note = absl::StrCat(sizes, ", --keep_global_batch: each rank accumulates ",
                             layout.Passes(), " micro-batches of ", batch, " a step (", grad_accum,
                             " at ", original_world, " ranks): ", kept);
    return plan;
  }
  const int more = static_cast<int>(micro_batches % world);  // ranks [0, more) take one more
  plan.note = absl::StrCat(
      sizes, ", --keep_global_batch: a step's ", micro_batches, " micro-batches of ", batch, " (",
      original_world, " ranks x --grad_accum=", grad_accum,
      ") split unevenly: ", Ranks(0, more - 1), " accumulate(s) ", layout.Passes(), " a step and ",
      Ranks(more, world - 1), " ", layout.Passes() - 1,
      " and a pass without data (the step's collectives); the gradient is their sum over ",
      micro_batches, ": ", kept);
  return plan;
}

}  // namespace zeroshard
