// Streaming DiLoCo's schedule in the worker (--outer_fragments,
// --outer_delay; docs/diloco.md): after each step, the pending fragment's
// outer step finished when its τ steps have passed, then the next
// fragment's begun when its turn has come (one every H / F steps, fragment
// p after steps (k F + p + 1) H / F); at the last step and at each
// checkpoint or snapshot step instead a full outer step, the pending
// fragment finished first, so that the run ends with, and every checkpoint
// and snapshot holds, one model. (Every outer step's record:
// worker_outer_elastic.cc.)
#include <algorithm>
#include <cmath>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "common/status_context.h"
#include "worker/outer_sync_config.h"
#include "worker/worker.h"

namespace zeroshard {

absl::Status Worker::StreamOuterStep(int completed) {
  ZeroEngine& e = *generation_->engine;
  const OuterOptions& outer = config_.engine.outer;
  const bool full = FullOuterStepAfter(config_, completed);
  // The pending fragment first: due τ steps after it began, or now, before
  // a full outer step.
  if (e.pending_outer_fragment() >= 0 &&
      (full || completed >= e.pending_outer_tag() + outer.delay)) {
    absl::StatusOr<OuterStats> done = e.FinishOuterFragment();
    if (!done.ok()) {
      return Annotate(done.status(), absl::StrCat("fragment's outer step after ", completed));
    }
    if (absl::Status s = RecordOuterStep(completed, *done); !s.ok()) return s;
  }
  if (full) {
    absl::StatusOr<OuterStats> all = e.OuterStep();
    if (!all.ok()) return Annotate(all.status(), absl::StrCat("full outer step after ", completed));
    return RecordOuterStep(completed, *all);
  }
  const int fragment = FragmentBeganAfter(completed, outer);
  if (fragment < 0) return absl::OkStatus();
  if (absl::Status s = e.BeginOuterFragment(fragment, completed); !s.ok()) {
    return Annotate(s, absl::StrCat("fragment ", fragment, "'s outer step after ", completed));
  }
  if (outer.delay > 0) return absl::OkStatus();
  // τ = 0: applied at once, the compute thread waiting for the all-reduce.
  absl::StatusOr<OuterStats> done = e.FinishOuterFragment();
  if (!done.ok()) {
    return Annotate(done.status(), absl::StrCat("fragment's outer step after ", completed));
  }
  return RecordOuterStep(completed, *done);
}

}  // namespace zeroshard
