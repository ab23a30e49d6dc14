// ZeroEngine's DiLoCo outer step (engine.h, EngineOptions::replica_sync):
// the outer state (anchor, outer momentum, error-feedback residual) of this
// rank's shard, and the outer step over the replicas' communicator.
//
// DiLoCo (Douillard et al., "DiLoCo: Distributed Low-Communication Training
// of Language Models", 2023): each shard group trains on its own for H steps
// (its inner optimizer, gradients averaged inside the group only); then
//   outer_grad = anchor - params           (this group's change, negated)
//   outer_grad = mean over the groups      (the replicas' all-reduce)
//   anchor     = SGD(lr, momentum, nesterov).step(anchor, outer_grad)
//   params     = anchor                    (in every group)
// A shard's replicas are the ranks holding it in the other groups, so the
// mean over the replicas' communicator is the mean over the groups, done
// shard by shard with no rank holding more than its shard. Streaming
// DiLoCo's fragments (engine_outer_stream.cc) reuse this file's parts:
// OuterGradientInto, AllReduceOuterGradient (there on the replica thread)
// and ApplyOuterGradient (there with the mix).
#include <algorithm>
#include <cassert>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "worker/comm/quantized.h"
#include "worker/zero/engine.h"
#include "worker/zero/engine_internal.h"

namespace zeroshard {

using engine_internal::Bytes;
using engine_internal::MsSince;

namespace engine_internal {

absl::Status ValidateOuterOptions(const EngineOptions& options, int replicas) {
  if (options.replica_sync != ReplicaSync::kDiLoCo) return absl::OkStatus();
  const OuterOptions& outer = options.outer;
  // One group is allowed: a recovery that left a single group goes on, its
  // outer step the group's own outer SGD on its own change (no collective).
  // A job that starts with one group is refused by the flags
  // (outer_sync_config.cc), where W / G is known before the job forms.
  if (replicas < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("DiLoCo needs at least one shard group; this plan has ", replicas));
  }
  if (options.stage < 1 || options.stage > 3) {
    return absl::InvalidArgumentError(absl::StrCat(
        "DiLoCo runs over shard groups, which need stage 1, 2 or 3; got stage ", options.stage));
  }
  if (outer.every < 1 || !(outer.lr > 0) || !(outer.momentum >= 0 && outer.momentum < 1)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "DiLoCo's outer step every ", outer.every, " steps at lr ", outer.lr, " momentum ",
        outer.momentum, ": expected every >= 1, lr > 0 and momentum in [0, 1)"));
  }
  if (outer.wire < OuterWire::kF32 || outer.wire > OuterWire::kInt4) {
    return absl::InvalidArgumentError(
        absl::StrCat("outer wire ", static_cast<int>(outer.wire),
                     " is not supported: expected f32, bf16, int8 or int4"));
  }
  if (outer.fragments < 1 || outer.delay < 0 || !(outer.mix >= 0 && outer.mix <= 1)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "streaming DiLoCo with ", outer.fragments, " fragments, delay ", outer.delay, ", mix ",
        outer.mix, ": expected fragments >= 1, delay >= 0 and mix in [0, 1]"));
  }
  if (QuantizedOuterWire(outer.wire) && options.backend != nullptr &&
      !options.backend->host_accessible()) {
    return absl::InvalidArgumentError(
        absl::StrCat(OuterWireName(outer.wire), " outer steps quantize on host memory; backend '",
                     options.backend->name(), "' is not: use an f32 or bf16 outer dtype there"));
  }
  return absl::OkStatus();
}

}  // namespace engine_internal

// Counted as optimizer state: the anchor and the outer momentum are the
// outer optimizer's (and the residual its error feedback's), all of them
// sharded like the inner optimizer's moments.
absl::Status ZeroEngine::AllocateOuterState() {
  if (options_.replica_sync != ReplicaSync::kDiLoCo) return absl::OkStatus();
  const OuterOptions& outer = options_.outer;
  OptimizerOptions sgd;
  sgd.momentum = outer.momentum;
  sgd.nesterov = outer.momentum > 0;  // torch.optim.SGD rejects Nesterov without momentum
  int64_t largest = 0;
  for (size_t u = 0; u < units_.size(); ++u) {
    const int64_t chunk = units_[u].chunk_elements;
    largest = std::max(largest, chunk);
    UnitState& st = *state_[u];
    st.anchor = TrackedBuffer(&memory_, MemoryCategory::kOptimizerState, Bytes(chunk, DType::kF32));
    if (outer.wire != OuterWire::kF32) {
      st.outer_residual =
          TrackedBuffer(&memory_, MemoryCategory::kOptimizerState, Bytes(chunk, DType::kF32));
    }
    auto optimizer = backend_->MakeOptimizer("sgd", chunk, sgd);
    if (!optimizer.ok()) {
      return absl::Status(optimizer.status().code(),
                          absl::StrCat("DiLoCo's outer optimizer: ", optimizer.status().message()));
    }
    st.outer_optimizer = std::move(*optimizer);
    memory_.Add(MemoryCategory::kOptimizerState, st.outer_optimizer->StateBytes());
  }
  outer_delta_ = TrackedBuffer(&memory_, MemoryCategory::kCommBuffers, Bytes(largest, DType::kF32));
  if (outer.wire == OuterWire::kBF16) {
    outer_wire_ =
        TrackedBuffer(&memory_, MemoryCategory::kCommBuffers, Bytes(largest, DType::kBF16));
  }
  if (outer.wire == OuterWire::kInt8) outer_packed_.resize(Int8PackedBytes(largest));
  if (outer.wire == OuterWire::kInt4) outer_packed_.resize(Int4PackedBytes(largest));
  return PlanOuterFragments();
}

// The parameters Initialize wrote are the next outer step's anchor; the
// outer momentum and the residual start again (a checkpoint's outer state
// is loaded after this: InitializeOuterState).
absl::Status ZeroEngine::ResetOuterState() {
  if (options_.replica_sync != ReplicaSync::kDiLoCo) return absl::OkStatus();
  // A streaming fragment begun before the state now restored is not applied.
  if (absl::Status s = DropPendingFragment(); !s.ok()) return s;
  for (size_t u = 0; u < units_.size(); ++u) {
    UnitState& st = *state_[u];
    MasterShardInto(static_cast<int>(u), st.anchor.f32());
    if (!st.outer_residual.empty()) {
      backend_->Zero(st.outer_residual.data(), st.outer_residual.bytes());
    }
    // step 0 marks SGD's momentum buffer as not yet initialized (optimizer.h).
    st.outer_optimizer->set_step(0);
  }
  return backend_->Synchronize();
}

void ZeroEngine::MasterShardInto(int unit, float* out) {
  const UnitLayout& layout = units_[unit];
  UnitState& st = *state_[unit];
  if (!st.master.empty()) {  // stage 3, or a bf16 run's f32 master at stages 1-2
    backend_->Copy(out, st.master.data(), Bytes(layout.chunk_elements, DType::kF32));
  } else {  // f32 stages 1-2: the replicated parameters are their own master
    PackOwn(layout, st.replicated.f32(), out);
  }
}

// Without --outer_timeout every group takes part in every outer step: no
// group can be stale, and nothing is agreed first (the bytes sent are the
// outer all-reduce's alone).
absl::StatusOr<OuterStats> ZeroEngine::OuterStep() {
  return RunOuterStep(replica_comm_, /*elastic=*/false);
}

absl::Status ZeroEngine::CheckOuterStepAllowed() const {
  if (options_.replica_sync != ReplicaSync::kDiLoCo) {
    return absl::FailedPreconditionError(
        "OuterStep is DiLoCo's (--sync=diloco); this engine syncs the replicas every step");
  }
  if (step_pending_) {
    return absl::FailedPreconditionError(
        "OuterStep between a step's micro-batches: call it after Step");
  }
  if (pending_.fragment >= 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "OuterStep while streaming fragment ", pending_.fragment,
        "'s outer step is pending: FinishOuterFragment first (one model needs it applied)"));
  }
  return absl::OkStatus();
}

absl::Status ZeroEngine::DropEarlyGathers() {
  ReleaseHeldParameters();
  if (absl::Status s = reduce_thread_->Drain(); !s.ok()) return s;
  if (absl::Status s = gather_thread_->Drain(); !s.ok()) return s;
  slots_.clear();
  return absl::OkStatus();
}

absl::Status ZeroEngine::ApplyOuterGradient(int unit, float* delta, double mix, OuterStats* stats) {
  UnitState& st = *state_[unit];
  const int64_t n = units_[unit].chunk_elements;
  absl::StatusOr<double> squares = backend_->SquaredNorm(delta, n);
  if (!squares.ok()) return squares.status();
  stats->shard_squares += *squares;
  if (!st.outer_residual.empty()) {
    absl::StatusOr<double> kept = backend_->SquaredNorm(st.outer_residual.f32(), n);
    if (!kept.ok()) return kept.status();
    stats->residual_squares += *kept;
  }
  if (absl::Status s = st.outer_optimizer->Step(st.anchor.f32(), delta, n, options_.outer.lr);
      !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("outer step of ", Where(unit), ": ", s.message()));
  }
  // The new parameters: the anchor, or (streaming's merge) the anchor plus
  // `mix` of the local change since, in the outer gradient's buffer, which
  // the step has consumed: delta = anchor - master, then
  // anchor + (-mix) delta.
  const float* merged = st.anchor.f32();
  if (mix > 0) {
    MasterShardInto(unit, delta);
    backend_->Scale(delta, n, -1.0f);
    backend_->AddInto(st.anchor.data(), DType::kF32, delta, n);
    backend_->Scale(delta, n, static_cast<float>(-mix));
    backend_->AddInto(st.anchor.data(), DType::kF32, delta, n);
    merged = delta;
  }
  // master = merged, and what is derived from it.
  if (stage_.params_sharded) {
    backend_->Copy(st.master.data(), merged, Bytes(n, DType::kF32));
    st.secondary_fresh = false;  // hpZ: rebuilt by the next primary gather
    return absl::OkStatus();
  }
  if (!st.master.empty()) {  // bf16 parameters: the f32 master, then the bf16 copy
    backend_->Copy(st.master.data(), merged, Bytes(n, DType::kF32));
    return AllGatherReplicated(unit, st.master.f32());
  }
  return AllGatherReplicated(unit, merged);
}

// delta = anchor - master: the negated change (-master + anchor, the same
// rounding as anchor - master), plus the residual (error feedback: what the
// last one's wire lost). bf16, int8, int4: the part of this rank's delta its
// wire copy loses is kept in the residual for the next outer step, so no
// change is lost for good, only delayed.
absl::Status ZeroEngine::OuterGradientInto(Communicator* comm, int unit, float* delta, void* wire) {
  UnitState& st = *state_[unit];
  const int64_t n = units_[unit].chunk_elements;
  MasterShardInto(unit, delta);
  backend_->Scale(delta, n, -1.0f);
  backend_->AddInto(st.anchor.data(), DType::kF32, delta, n);
  float* residual = st.outer_residual.f32();
  if (residual != nullptr) backend_->AddInto(residual, DType::kF32, delta, n);
  if (comm == nullptr) {
    // One group (a recovery left no other): the mean over one group is its
    // own change, sent nowhere, so nothing is lost to a wire copy and the
    // residual (already added into `delta`) is spent.
    if (residual != nullptr) backend_->Zero(residual, Bytes(n, DType::kF32));
    return backend_->Synchronize();
  }
  const OuterWire wire_format = options_.outer.wire;
  if (wire_format == OuterWire::kBF16) {
    // residual = delta - widen(bf16(delta)), through residual = -(-delta + wire).
    backend_->Convert(delta, DType::kF32, wire, DType::kBF16, n);
    backend_->Copy(residual, delta, Bytes(n, DType::kF32));
    backend_->Scale(residual, n, -1.0f);
    backend_->AddInto(wire, DType::kBF16, residual, n);
    backend_->Scale(residual, n, -1.0f);
  } else if (QuantizedOuterWire(wire_format)) {
    // The same nearest rounding QuantizedAllReduce(Int4) sends (host memory).
    if (wire_format == OuterWire::kInt8) {
      QuantizeInt8(delta, n, outer_packed_.data());
      DequantizeInt8(outer_packed_.data(), n, 0, n, residual);
    } else {
      QuantizeInt4(delta, n, outer_packed_.data());
      DequantizeInt4(outer_packed_.data(), n, 0, n, residual);
    }
    for (int64_t i = 0; i < n; ++i) residual[i] = delta[i] - residual[i];
    return absl::OkStatus();
  }
  return backend_->Synchronize();
}

// The mean of every replica's `delta` (whole chunks; padding is zero), in
// place, sent in the outer dtype (bf16: `wire`, widened back into delta).
// On the calling thread: the compute thread (OuterStep) or the replica
// thread (a streaming fragment).
absl::Status ZeroEngine::AllReduceOuterGradient(Communicator* comm, int unit, float* delta,
                                                void* wire) {
  if (comm == nullptr) return absl::OkStatus();  // one group: its own mean
  const UnitLayout& layout = units_[unit];
  const int64_t n = layout.chunk_elements;
  const OuterWire wire_format = options_.outer.wire;
  absl::Status s;
  EnterCollective(kReplicaStream, "all_reduce", layout.name);
  if (wire_format == OuterWire::kBF16) {
    s = comm->AllReduce(wire, n, DType::kBF16, ReduceOp::kAverage, options_.collective_timeout);
    if (s.ok()) {
      backend_->Convert(wire, DType::kBF16, delta, DType::kF32, n);
      s = backend_->Synchronize();
    }
  } else if (wire_format == OuterWire::kInt8) {
    s = QuantizedAllReduce(comm, delta, n, ReduceOp::kAverage, options_.collective_timeout);
  } else if (wire_format == OuterWire::kInt4) {
    s = QuantizedAllReduceInt4(comm, delta, n, ReduceOp::kAverage, options_.collective_timeout);
  } else {
    s = comm->AllReduce(delta, n, DType::kF32, ReduceOp::kAverage, options_.collective_timeout);
  }
  LeaveCollective(kReplicaStream);
  if (!s.ok()) {
    return absl::Status(s.code(), absl::StrCat("outer all_reduce over the replicas of ",
                                               Where(unit), ": ", s.message()));
  }
  return absl::OkStatus();
}

}  // namespace zeroshard
