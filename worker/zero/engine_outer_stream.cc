// Streaming DiLoCo (Douillard et al. 2025, "Streaming DiLoCo with
// overlapping communication: Towards a Distributed Free Lunch"): the
// model's units split into F fragments, each synced on its own outer step
// (engine.h's BeginOuterFragment / FinishOuterFragment; the worker rotates
// them, one every H / F steps, so each is synced every H steps), and each
// fragment's all-reduce over the replicas runs on the replica thread while
// the compute thread goes on with the next inner steps. When the worker
// finishes it (τ steps later) the fragment's parameters become
//   anchor + mix (master - anchor)
// — the outer result moved `mix` of the way to this group's own parameters
// of the moment, τ steps on (the paper's α) — and the anchor stays the outer result, from which the
// fragment's next outer gradient is measured.
//
// The outer gradient of the fragment is computed at the begin, on the
// compute thread, into a buffer planned at Create (the largest fragment's
// chunks); the replica thread reads only that buffer (and its bf16 wire
// copy), and the anchor, the outer momentum and the residual change only at
// the finish, on the compute thread: the inner steps in between touch none
// of what the all-reduce reads.
#include <algorithm>
#include <cmath>
#include <thread>

#include "absl/strings/str_cat.h"
#include "worker/zero/engine.h"
#include "worker/zero/engine_internal.h"

namespace zeroshard {

using engine_internal::At;
using engine_internal::Bytes;
using engine_internal::MsSince;

// Contiguous runs of units balanced by parameter count: the cut before
// fragment k (1 <= k < F) goes after the unit at which the running count
// comes nearest to k / F of the total, moved as little as needed to leave
// each fragment one unit or more. Every fragment is then within one unit of
// an F-th of the model.
absl::Status ZeroEngine::PlanOuterFragments() {
  fragment_begin_.clear();
  if (!streaming_outer()) return absl::OkStatus();
  const int f = options_.outer.fragments;
  const int units = static_cast<int>(units_.size());
  if (f > units) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--outer_fragments=", f, ": a fragment is one or more whole units and this model has ",
        units, ": use --outer_fragments=", units, " or fewer"));
  }
  std::vector<double> running(units + 1, 0);  // running[u]: the count of units [0, u)
  for (int u = 0; u < units; ++u) running[u + 1] = running[u] + units_[u].flat_elements;
  fragment_begin_.assign(f + 1, 0);
  fragment_begin_[f] = units;
  for (int k = 1; k < f; ++k) {
    const double target = running[units] * k / f;
    int cut = fragment_begin_[k - 1] + 1;  // at least one unit in fragment k - 1
    for (int c = cut + 1; c <= units - (f - k); ++c) {
      if (std::fabs(running[c] - target) < std::fabs(running[cut] - target)) cut = c;
    }
    fragment_begin_[k] = cut;
  }
  fragment_offset_.assign(units, 0);
  int64_t largest = 0;
  for (int p = 0; p < f; ++p) {
    int64_t at = 0;
    for (int u = fragment_begin_[p]; u < fragment_begin_[p + 1]; ++u) {
      fragment_offset_[u] = at;
      at += units_[u].chunk_elements;
    }
    largest = std::max(largest, at);
  }
  fragment_delta_ =
      TrackedBuffer(&memory_, MemoryCategory::kCommBuffers, Bytes(largest, DType::kF32));
  if (options_.outer.wire == OuterWire::kBF16) {
    fragment_wire_ =
        TrackedBuffer(&memory_, MemoryCategory::kCommBuffers, Bytes(largest, DType::kBF16));
  }
  return absl::OkStatus();
}

absl::Status ZeroEngine::BeginOuterFragment(int fragment, int64_t tag) {
  if (!streaming_outer()) {
    return absl::FailedPreconditionError(
        "BeginOuterFragment is streaming DiLoCo's (--sync=diloco with --outer_fragments > 1 or "
        "--outer_delay > 0); this engine planned no fragments");
  }
  if (fragment < 0 || fragment >= outer_fragments()) {
    return absl::InvalidArgumentError(absl::StrCat("fragment ", fragment, " of ", outer_fragments(),
                                                   ": expected 0 to ", outer_fragments() - 1));
  }
  if (step_pending_) {
    return absl::FailedPreconditionError(
        "BeginOuterFragment between a step's micro-batches: call it after Step");
  }
  if (pending_.fragment >= 0) {
    return absl::FailedPreconditionError(absl::StrCat("fragment ", pending_.fragment,
                                                      "'s outer step is still pending: finish it "
                                                      "before beginning fragment ",
                                                      fragment));
  }
  const absl::Time start = absl::Now();
  const int first = OuterFragmentUnits(fragment).first;
  const int last = OuterFragmentUnits(fragment).second;
  float* deltas = fragment_delta_.f32();
  void* wires = fragment_wire_.data();
  for (int u = first; u < last; ++u) {
    const int64_t at = fragment_offset_[u];
    void* wire = wires == nullptr ? nullptr : At(wires, at, DType::kBF16);
    if (absl::Status s = OuterGradientInto(replica_comm_, u, deltas + at, wire); !s.ok()) return s;
  }
  if (absl::Status s = backend_->Synchronize(); !s.ok()) return s;
  pending_ = PendingFragment{fragment, tag};
  const std::thread::id compute_thread = std::this_thread::get_id();
  pending_.ticket = replica_thread_->Submit([this, first, last, deltas, wires, compute_thread] {
    const absl::Time began = absl::Now();
    const CollectiveBytes before = replica_comm_->bytes_sent();
    for (int u = first; u < last; ++u) {
      const int64_t at = fragment_offset_[u];
      void* wire = wires == nullptr ? nullptr : At(wires, at, DType::kBF16);
      if (absl::Status s = AllReduceOuterGradient(replica_comm_, u, deltas + at, wire); !s.ok())
        return s;
    }
    const CollectiveBytes sent = replica_comm_->bytes_sent() - before;
    fragment_done_.bytes_sent =
        sent.all_reduce + sent.all_gather + sent.reduce_scatter + sent.broadcast;
    fragment_done_.on_replica_thread = std::this_thread::get_id() != compute_thread;
    fragment_done_.ms = MsSince(began);
    return absl::OkStatus();
  });
  pending_.begin_ms = MsSince(start);
  return absl::OkStatus();
}

absl::StatusOr<OuterStats> ZeroEngine::FinishOuterFragment() {
  if (pending_.fragment < 0) {
    return absl::FailedPreconditionError("FinishOuterFragment with no fragment begun");
  }
  if (step_pending_) {
    return absl::FailedPreconditionError(
        "FinishOuterFragment between a step's micro-batches: call it after Step");
  }
  const absl::Time start = absl::Now();
  const PendingFragment pending = pending_;
  pending_ = PendingFragment{};  // not pending any more, whatever comes next
  absl::Status waited = replica_thread_->Wait(pending.ticket);
  OuterStats stats;
  stats.wait_ms = MsSince(start);
  if (!waited.ok()) return waited;
  const FragmentAllReduce done = fragment_done_;  // the task's, ordered by Wait
  if (absl::Status s = DropEarlyGathers(); !s.ok()) return s;
  const auto [first, last] = OuterFragmentUnits(pending.fragment);
  for (int u = first; u < last; ++u) {
    float* delta = fragment_delta_.f32() + fragment_offset_[u];
    if (absl::Status s = ApplyOuterGradient(u, delta, options_.outer.mix, &stats); !s.ok()) {
      return s;
    }
  }
  if (absl::Status s = backend_->Synchronize(); !s.ok()) return s;
  stats.outer_step = ++outer_steps_;
  stats.fragment = pending.fragment;
  stats.began_tag = pending.tag;
  stats.bytes_sent = done.bytes_sent;
  stats.on_replica_thread = done.on_replica_thread;
  stats.all_reduce_ms = done.ms;
  stats.ms = pending.begin_ms + MsSince(start);
  return stats;
}

absl::Status ZeroEngine::DropPendingFragment() {
  if (pending_.fragment < 0) return absl::OkStatus();
  const int64_t ticket = pending_.ticket;
  pending_ = PendingFragment{};
  return replica_thread_->Wait(ticket);
}

}  // namespace zeroshard
