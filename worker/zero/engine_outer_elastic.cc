// Elastic DiLoCo outer steps (--outer_timeout; docs/diloco.md, "Elastic
// outer steps"): the outer step over the groups a quorum let in, and the
// catch-up of a group that missed outer steps.
//
// A group left out of an outer step keeps its old anchor, outer momentum and
// outer step count, and trains on. At the next outer step it takes part in,
// the present groups first agree who is up to date (the most outer steps
// taken); if some are not, the lowest up-to-date group broadcasts its anchor,
// outer momentum and counts to the stale ones, which then add zero to the
// mean, and the mean is scaled by present / up-to-date: the outer gradient is
// the mean over the up-to-date groups alone. Every present group applies the
// same step to the same anchor, so they end identical; the stale group's
// inner progress since its old anchor is dropped (it was measured from an
// anchor no other group holds any more).
#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "worker/zero/engine.h"
#include "worker/zero/engine_internal.h"

namespace zeroshard {

using engine_internal::Bytes;
using engine_internal::MsSince;

absl::StatusOr<OuterStats> ZeroEngine::OuterStepAmong(Communicator* present) {
  return RunOuterStep(present, /*elastic=*/true);
}

absl::StatusOr<OuterStats> ZeroEngine::RunOuterStep(Communicator* present, bool elastic) {
  if (absl::Status s = CheckOuterStepAllowed(); !s.ok()) return s;
  if (present != nullptr && present->world_size() < 2) present = nullptr;  // alone
  const absl::Time start = absl::Now();
  if (absl::Status s = DropEarlyGathers(); !s.ok()) return s;
  const CollectiveBytes before = present != nullptr ? present->bytes_sent() : CollectiveBytes{};
  OuterStats stats;
  OuterProgress progress;
  if (present != nullptr && elastic) {
    absl::StatusOr<OuterProgress> agreed = AgreeOuterProgress(present);
    if (!agreed.ok()) return agreed.status();
    progress = *agreed;
    if (progress.stale_groups > 0) {
      if (absl::Status s = CatchUpOuterState(present, progress); !s.ok()) return s;
    }
  }
  // present / up-to-date: the all-reduce's mean over every present group,
  // stale ones adding zero, becomes the mean over the up-to-date ones.
  const int groups = present != nullptr ? present->world_size() : 1;
  const float widen =
      static_cast<float>(groups) / static_cast<float>(groups - progress.stale_groups);
  float* delta = outer_delta_.f32();
  void* wire = outer_wire_.data();
  for (size_t u = 0; u < units_.size(); ++u) {
    const int unit = static_cast<int>(u);
    const int64_t n = units_[u].chunk_elements;
    if (progress.stale) {
      if (absl::Status s = ZeroStaleOuterGradient(unit, delta, wire); !s.ok()) return s;
    } else if (absl::Status s = OuterGradientInto(present, unit, delta, wire); !s.ok()) {
      return s;
    }
    if (absl::Status s = AllReduceOuterGradient(present, unit, delta, wire); !s.ok()) return s;
    if (progress.stale_groups > 0) backend_->Scale(delta, n, widen);
    if (absl::Status s = ApplyOuterGradient(unit, delta, /*mix=*/0, &stats); !s.ok()) return s;
  }
  if (absl::Status s = backend_->Synchronize(); !s.ok()) return s;
  const CollectiveBytes sent =
      present != nullptr ? present->bytes_sent() - before : CollectiveBytes{};
  stats.bytes_sent = sent.all_reduce + sent.all_gather + sent.reduce_scatter + sent.broadcast;
  stats.outer_step = ++outer_steps_;
  stats.caught_up = progress.stale;
  stats.stale_groups = progress.stale_groups;
  stats.ms = MsSince(start);
  return stats;
}

// Each present group's outer step count and its outer SGD's step (the
// momentum buffer's "initialized" mark), gathered over `present` (one rank
// per group: every rank of a group holds the same counts). Doubles travel
// as raw bytes, two f32 words each (as ShareStepNumerics sends them).
absl::StatusOr<ZeroEngine::OuterProgress> ZeroEngine::AgreeOuterProgress(Communicator* present) {
  const int groups = present->world_size();
  // Any unit's outer optimizer: every unit steps together.
  const double mine[2] = {static_cast<double>(outer_steps_),
                          static_cast<double>(state_[0]->outer_optimizer->step())};
  std::vector<double> all(2 * groups);
  if (absl::Status s =
          present->AllGather(mine, all.data(), 4, DType::kF32, options_.collective_timeout);
      !s.ok()) {
    return absl::Status(
        s.code(), absl::StrCat("agreeing the present groups' outer step counts: ", s.message()));
  }
  OuterProgress progress;
  double newest = -1;
  for (int g = 0; g < groups; ++g) newest = std::max(newest, all[2 * g]);
  for (int g = 0; g < groups; ++g) {
    if (all[2 * g] < newest) {
      ++progress.stale_groups;
    } else if (progress.root < 0) {
      progress.root = g;
    }
  }
  progress.stale = all[2 * present->rank()] < newest;
  progress.outer_steps = static_cast<int64_t>(newest);
  progress.optimizer_step = static_cast<int64_t>(all[2 * progress.root + 1]);
  return progress;
}

// The root's anchor and outer momentum, unit by unit, to every present
// group (the up-to-date ones receive what they hold already: one broadcast
// serves both), and its counts to the stale groups.
absl::Status ZeroEngine::CatchUpOuterState(Communicator* present, const OuterProgress& progress) {
  for (size_t u = 0; u < units_.size(); ++u) {
    UnitState& st = *state_[u];
    const int64_t n = units_[u].chunk_elements;
    absl::Status s = present->Broadcast(st.anchor.data(), n, DType::kF32, progress.root,
                                        options_.collective_timeout);
    float* momentum = st.outer_optimizer->exp_avg();
    if (s.ok() && momentum != nullptr) {
      s = present->Broadcast(momentum, n, DType::kF32, progress.root, options_.collective_timeout);
    }
    if (!s.ok()) {
      return absl::Status(s.code(), absl::StrCat("catching up a stale group's outer state of ",
                                                 Where(static_cast<int>(u)), ": ", s.message()));
    }
    st.outer_optimizer->set_step(progress.optimizer_step);
  }
  outer_steps_ = progress.outer_steps;
  return absl::OkStatus();
}

// A stale group adds zero to the mean: its change was measured from an
// anchor the others no longer hold. Its residual (what its wire copies lost
// of that change) goes with it.
absl::Status ZeroEngine::ZeroStaleOuterGradient(int unit, float* delta, void* wire) {
  UnitState& st = *state_[unit];
  const int64_t n = units_[unit].chunk_elements;
  backend_->Zero(delta, Bytes(n, DType::kF32));
  if (wire != nullptr && options_.outer.wire == OuterWire::kBF16) {
    backend_->Zero(wire, Bytes(n, DType::kBF16));
  }
  if (!st.outer_residual.empty())
    backend_->Zero(st.outer_residual.data(), st.outer_residual.bytes());
  return backend_->Synchronize();
}

}  // namespace zeroshard
