// Streaming DiLoCo's schedule in the worker (--outer_fragments,
// --outer_delay; docs/diloco.md): after each step, the pending fragment's
// outer step finished when its τ steps have passed, then the next
// fragment's begun when its turn has come (one every H / F steps, fragment
// p after steps (k F + p + 1) H / F); at the last step and at each
// checkpoint or snapshot step instead a full outer step, the pending
// fragment finished first, so that the run ends with, and every checkpoint
// and snapshot holds, one model. And every outer step's record in the run
// report.
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

absl::Status Worker::RecordOuterStep(int completed, const OuterStats& outer) {
  ZeroEngine& e = *generation_->engine;
  // Every replica holds the same averaged outer gradient: the sum of the
  // ranks' squares counts it W / G times.
  absl::StatusOr<double> mean_squares = e.MeanOverRanks(outer.shard_squares, "outer squares");
  if (!mean_squares.ok()) return Annotate(mean_squares.status(), "outer step");
  const double norm = std::sqrt(*mean_squares * e.group_size());
  // Numbered by the run's steps, not this engine's count: a recovery (a new
  // engine) or a resume goes on with the run's numbers. Streaming: one
  // number per H / F steps (a fragment's turn), by the step it began after.
  const OuterOptions& options = config_.engine.outer;
  const int period = std::max(1, options.every / std::max(1, options.fragments));
  const int64_t began = outer.fragment >= 0 ? outer.began_tag : completed;
  const int64_t number = (began + period - 1) / period;
  // Every group of the generation took part (a recovery that lost a group
  // formed a generation without it; docs/diloco.md, "Elastic outer steps").
  const int groups = e.world_size() / e.group_size();
  const int64_t generation = generation_->membership.generation;
  OuterStepRecord record;
  record.after_step = completed;
  record.outer_step = number;
  record.groups = groups;
  record.generation = generation;
  record.bytes_sent = outer.bytes_sent;
  record.ms = outer.ms;
  record.outer_grad_norm = norm;
  record.residual_norm = std::sqrt(outer.residual_squares);
  record.fragment = outer.fragment;
  record.began_after_step = began;
  record.on_replica_thread = outer.on_replica_thread;
  record.all_reduce_ms = outer.all_reduce_ms;
  record.wait_ms = outer.wait_ms;
  metrics_.outer_steps.push_back(record);
  if (rank_ == 0) {
    v1::OuterStepRecord sent;
    sent.set_outer_step(number);
    sent.set_after_step(completed);
    sent.set_generation(generation);
    sent.set_groups(groups);
    sent.set_group_size(e.group_size());
    client_->ReportOuterStep(sent);
    const std::string what = outer.fragment < 0
                                 ? std::string("")
                                 : absl::StrCat(" (fragment ", outer.fragment,
                                                ", begun after step ", outer.began_tag, ")");
    std::fprintf(stderr,
                 "outer step %lld after step %d%s: outer_grad_norm %.6f  %.1f ms  %lld bytes  "
                 "%d group(s)\n",
                 static_cast<long long>(number), completed, what.c_str(), norm, outer.ms,
                 static_cast<long long>(outer.bytes_sent), groups);
  }
  return absl::OkStatus();
}

}  // namespace zeroshard
