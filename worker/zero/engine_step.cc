// ZeroEngine's step (engine.h): the gradient's norm over ranks and the
// step's verdict, clipping, and each unit's optimizer update.
#include <algorithm>
#include <cassert>
#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/shard_hash.h"
#include "worker/zero/engine.h"
#include "worker/zero/engine_internal.h"

namespace zeroshard {

using engine_internal::Bytes;
using engine_internal::MsSince;

std::pair<float*, int64_t> ZeroEngine::StepGradient(int u) {
  UnitState& st = *state_[u];
  if (!stage_.state_sharded) return {st.grads.f32(), units_[u].flat_elements};
  if (stage_.reduce_at_step) return {st.reduced.f32(), units_[u].chunk_elements};
  return {st.grads.f32(), units_[u].chunk_elements};
}

absl::StatusOr<double> ZeroEngine::LocalGradientSquares() {
  for (auto& st : state_) {
    if (st->grads_stale) {  // no reduction this step (Step without a backward)
      backend_->Zero(st->grads.data(), st->grads.bytes());
      st->grads_stale = false;
    }
  }
  // Average over micro-batches (the reductions averaged over ranks), or the
  // sum over every rank's micro-batches divided by their number
  // (global_micro_batches: the reductions summed); the squared norm of that
  // gradient here.
  const float scale = options_.global_micro_batches > 0
                          ? 1.0f / static_cast<float>(options_.global_micro_batches)
                          : 1.0f / static_cast<float>(options_.grad_accum);
  double squares = 0;
  for (size_t u = 0; u < units_.size(); ++u) {
    auto [g, n] = StepGradient(u);
    if (g == nullptr) return absl::InternalError(absl::StrCat("no gradient for ", Where(u)));
    if (scale != 1.0f) backend_->Scale(g, n, scale);
    std::optional<double>& known = state_[u]->grad_squares;
    if (known.has_value()) {
      // Taken before the scaling (exact for powers of two, within rounding
      // otherwise).
      squares += *known * static_cast<double>(scale) * static_cast<double>(scale);
      known.reset();
      continue;
    }
    absl::StatusOr<double> unit_squares = backend_->SquaredNorm(g, n);
    if (!unit_squares.ok()) return unit_squares.status();
    squares += *unit_squares;
  }
  return squares;
}

absl::StatusOr<StepVerdict> ZeroEngine::ShareStepNumerics(double grad_squares) {
  // One all-gather of every rank's (loss, squares): the collective the
  // norm of shards always needed, now also the loss's mean and the verdict
  // (step_numerics.h). Doubles travel as raw bytes: two f32 words each.
  RankNumerics local;
  local.loss = micro_batches_ > 0 ? loss_sum_ / micro_batches_ : 0;
  local.micro_batches = micro_batches_;
  local.grad_squares = grad_squares;
  if (shard_checksum_.has_value()) {
    local.shard_checksum = *shard_checksum_;
    local.has_checksum = 1;
    shard_checksum_.reset();
  }
  std::vector<RankNumerics>& all = all_numerics_;  // planned at Create
  Communicator* comm = numerics_comm_;
  assert(static_cast<int>(all.size()) == comm->world_size());
  static_assert(sizeof(RankNumerics) == 10 * sizeof(float), "five 8-byte fields");
  absl::Status s =
      comm->AllGather(&local, all.data(), 10, DType::kF32, options_.collective_timeout);
  if (!s.ok()) {
    return absl::Status(s.code(),
                        absl::StrCat("all_gather of the step's loss and gradient norm "
                                     "(rank ",
                                     comm->rank(), " of ", comm->world_size(), "): ", s.message()));
  }
  // DiLoCo: the groups' gradients differ, and each clips by its own norm.
  StepVerdict verdict = JudgeStep(all, stage_.state_sharded, group_size_, comm->rank(),
                                  /*group_norms=*/options_.replica_sync == ReplicaSync::kDiLoCo);
  // Agreed inside the group (EngineOptions::numerics): its members are the
  // job's ranks from rank_ - comm->rank() on.
  if (verdict.first_rank >= 0) verdict.first_rank += rank_ - comm->rank();
  return verdict;
}

// A step that is not finite changes nothing: no parameter, no optimizer
// moment or step count. Its gradients are left stale, as an update leaves
// them, so the next step's first reduction or backward overwrites them; and
// zeroed, because not every element is overwritten: the padding of a
// gradient shard is written only by an int8 all-reduce over the replicas,
// which turns a whole block holding a NaN into NaN, padding included, while
// the reductions after it write the pieces alone (a NaN left there would
// make every later norm NaN).
void ZeroEngine::DropUpdate() {
  for (auto& st : state_) {
    if (st->grads.data() != nullptr) backend_->Zero(st->grads.data(), st->grads.bytes());
    st->grads_stale = true;
    st->reduced.Reset();
  }
}

absl::Status ZeroEngine::UpdateUnit(int u, double lr, double* param_sync_ms) {
  UnitState& st = *state_[u];
  auto [g, n] = StepGradient(u);
  const bool bf16_params = options_.param_dtype == DType::kBF16;
  if (stage_.params_sharded) {
    if (absl::Status s = st.optimizer->Step(st.master.f32(), g, n, lr); !s.ok()) return s;
    st.secondary_fresh = false;  // hpZ: until the next primary gather of the unit
    // The next pass's first positions (0..prefetch) can be gathered as soon
    // as their units are updated: the gathers overlap the rest of the
    // optimizer.
    for (int k = 0; k <= window_.EarlyEnd(); ++k) {
      if (window_.unit(k) != u) continue;
      if (absl::Status s = backend_->Synchronize(); !s.ok()) return s;
      if (absl::Status s = IssueGather(k); !s.ok()) return s;
    }
  } else if (!stage_.state_sharded) {
    float* p = bf16_params ? st.master.f32() : st.replicated.f32();
    if (absl::Status s = st.optimizer->Step(p, g, n, lr); !s.ok()) return s;
    if (bf16_params) {
      backend_->Convert(p, DType::kF32, st.replicated.data(), options_.param_dtype, n);
    }
  } else if (packed_) {
    if (absl::Status s = UpdateReplicatedPacked(u, g, n, lr, param_sync_ms); !s.ok()) return s;
  } else {
    TrackedBuffer packed;
    float* p = st.master.f32();
    if (!bf16_params) {  // fp32: the replicated parameters are their own master
      absl::StatusOr<TrackedBuffer> shard =
          buffers_.sync.Lend(MemoryCategory::kCommBuffers, Bytes(n, DType::kF32), /*zero=*/false);
      if (!shard.ok()) return shard.status();
      packed = std::move(*shard);
      PackOwn(units_[u], st.replicated.f32(), packed.f32());
      p = packed.f32();
    }
    if (absl::Status s = st.optimizer->Step(p, g, n, lr); !s.ok()) return s;
    absl::Time sync_start = absl::Now();
    absl::Status s = AllGatherReplicated(u, p);
    *param_sync_ms += MsSince(sync_start);
    if (!s.ok()) return s;
  }
  // The next step's first backward (stages 0-1) or first reduction (stages
  // 2-3) writes the gradient instead of adding to it: no clearing pass here.
  st.grads_stale = true;
  st.reduced.Reset();
  return absl::OkStatus();
}

absl::StatusOr<StepStats> ZeroEngine::Step(double lr) {
  ReleaseHeldParameters();  // the parameters are about to change
  absl::Time wait_start = absl::Now();
  if (absl::Status s = reduce_thread_->Drain(); !s.ok()) return s;
  // Not a streaming fragment's outer all-reduce: it overlaps the steps.
  if (per_step_replicas() && replica_thread_ != nullptr) {
    if (absl::Status s = replica_thread_->Drain(); !s.ok()) return s;
  }
  if (absl::Status s = gather_thread_->Drain(); !s.ok()) return s;
  times_.reduce_wait_ms += MsSince(wait_start);
  // Phase order: the reductions are done, and gave back what they held.
  step_pending_ = false;
  passes_ = 0;
  assert(buffers_.flat_grads.lent() == 0 && buffers_.received.lent() == 0 &&
         "every reduction gave its buffers back");
  absl::Time optimizer_start = absl::Now();
  StepStats stats;
  absl::StatusOr<double> squares = LocalGradientSquares();
  if (!squares.ok()) return squares.status();
  absl::StatusOr<StepVerdict> verdict = ShareStepNumerics(*squares);
  if (!verdict.ok()) return verdict.status();
  if (verdict_screen_) verdict_screen_(&*verdict);  // e.g. a loss spike, before any update
  stats.verdict = *verdict;
  stats.grad_norm = verdict->grad_norm;
  stats.loss = micro_batches_ > 0 ? loss_sum_ / micro_batches_ : 0;
  loss_sum_ = 0;
  micro_batches_ = 0;
  if (!verdict->apply()) {
    DropUpdate();
    times_.optimizer_ms += MsSince(optimizer_start);
    stats.times = times_;
    times_ = StepTimes();
    return stats;
  }
  if (options_.max_grad_norm > 0 && stats.grad_norm > options_.max_grad_norm) {
    const float clip = static_cast<float>(options_.max_grad_norm / (stats.grad_norm + 1e-6));
    for (size_t u = 0; u < units_.size(); ++u) {
      auto [g, n] = StepGradient(u);
      backend_->Scale(g, n, clip);
    }
  }
  double param_sync_ms = 0;
  std::optional<ShardHasher> hasher;
  if (hash_next_update_ && stage_.state_sharded) hasher.emplace();
  hash_next_update_ = false;
  for (size_t u = 0; u < units_.size(); ++u) {
    if (absl::Status s = UpdateUnit(static_cast<int>(u), lr, &param_sync_ms); !s.ok()) return s;
    // The chunk the optimizer just wrote is still in the cache.
    if (hasher.has_value()) {
      const absl::Time hash_start = absl::Now();
      if (absl::Status s = HashMasterShard(static_cast<int>(u), &*hasher); !s.ok()) return s;
      times_.replica_hash_ms += MsSince(hash_start);
    }
  }
  if (hasher.has_value()) shard_checksum_ = hasher->Digest();
  // The gather thread reads the updated shards next.
  if (absl::Status s = backend_->Synchronize(); !s.ok()) return s;
  times_.param_sync_ms += param_sync_ms;
  times_.optimizer_ms += MsSince(optimizer_start) - param_sync_ms;
  stats.times = times_;
  times_ = StepTimes();
  return stats;
}

}  // namespace zeroshard
