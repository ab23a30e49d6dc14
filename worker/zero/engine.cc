// ZeroEngine's core (engine.h): Create, the engine threads, the unit walk
// (ForwardBackward, Forward) and the collectives' activity. The walk's
// gathers are engine_gather.cc's, its reductions engine_reduce.cc's.
#include "worker/zero/engine.h"

#include <cassert>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "worker/zero/engine_internal.h"

namespace zeroshard {

using engine_internal::Bytes;
using engine_internal::MsSince;

void ZeroEngine::EnterCollective(Stream stream, const char* op, const std::string& unit) {
  if (options_.before_collective) {
    int64_t seq = 0;
    {
      absl::MutexLock lock(&activity_mu_);
      seq = entered_[stream] + 1;
    }
    options_.before_collective(op, seq);
  }
  absl::MutexLock lock(&activity_mu_);
  const absl::Time now = absl::Now();
  if (first_collective_start_ == absl::InfinitePast()) first_collective_start_ = now;
  activity_[stream] = {op, unit, ++entered_[stream], now};
}

void ZeroEngine::LeaveCollective(Stream stream) {
  collective_seq_.fetch_add(1);  // one finished
  absl::MutexLock lock(&activity_mu_);
  activity_[stream].op = nullptr;
}

ZeroEngine::CollectiveProgress ZeroEngine::Collectives() const {
  absl::MutexLock lock(&activity_mu_);
  CollectiveProgress progress;
  progress.gathers_entered = entered_[kGatherStream];
  // The group's reductions and the replicas' all-reduces: each stream's
  // collectives are issued in the same order on every rank.
  progress.reductions_entered = entered_[kReduceStream] + entered_[kReplicaStream];
  for (const CollectiveActivity& a : activity_) {
    if (a.op != nullptr && (progress.oldest.op == nullptr || a.started < progress.oldest.started)) {
      progress.oldest = a;
    }
  }
  return progress;
}

absl::Time ZeroEngine::TakeFirstCollectiveStart() {
  absl::MutexLock lock(&activity_mu_);
  return std::exchange(first_collective_start_, absl::InfinitePast());
}

std::string ZeroEngine::InFlight() const {
  absl::MutexLock lock(&activity_mu_);
  std::string out;
  for (const CollectiveActivity& a : activity_) {
    if (a.op == nullptr) continue;
    absl::StrAppend(&out, out.empty() ? "" : " and ", a.op, " of unit '", a.unit, "'");
  }
  return out;
}

std::string ZeroEngine::Where(int unit) const {
  return absl::StrCat("unit '", units_[unit].name, "' (rank ", rank_, " of ", world_, ")");
}

absl::StatusOr<std::unique_ptr<ZeroEngine>> ZeroEngine::Create(Model* model, const ShardPlan& plan,
                                                               Communicator* gather,
                                                               Communicator* reduce,
                                                               Communicator* aux,
                                                               const EngineOptions& options) {
  if (absl::Status s = engine_internal::ValidateOptions(options, plan, gather, reduce, aux);
      !s.ok()) {
    return s;
  }
  std::unique_ptr<ZeroEngine> engine(new ZeroEngine());
  engine->model_ = model;
  engine->gather_comm_ = gather;
  engine->reduce_comm_ = reduce;
  engine->aux_comm_ = aux;
  engine->options_ = options;
  engine->stage_ = StageTraits::Of(options.stage);
  engine->backend_ = options.backend != nullptr ? options.backend : CpuBackend();
  engine->memory_.set_backend(engine->backend_);
  engine->rank_ = aux->rank();
  engine->world_ = aux->world_size();
  engine->group_size_ = gather->world_size();
  if (engine->group_size_ < engine->world_) engine->replica_comm_ = options.replicas;
  engine->secondary_comm_ = options.secondary;
  engine->numerics_comm_ = options.numerics != nullptr ? options.numerics : aux;
  if (absl::Status s = engine->BuildLayouts(plan); !s.ok()) return s;
  engine->BuildSecondaryLayouts();
  if (absl::Status s = engine->BuildSchedule(); !s.ok()) return s;
  if (absl::Status s = engine->AllocateUnitStates(); !s.ok()) return s;
  if (absl::Status s = engine->AllocateOuterState(); !s.ok()) return s;
  if (absl::Status s = engine->SetUpSharedGather(); !s.ok()) return s;
  if (absl::Status s = engine->SetUpPackedCollectives(); !s.ok()) return s;
  engine->SetUpBackwardIntoShard();
  engine->PlanStepBuffers();
  engine->StartThreads();
  return engine;
}

absl::Status ZeroEngine::BuildSchedule() {
  // The pass: forward ops, then backward ops in reverse.
  ops_ = model_->ForwardOps();
  const int n = static_cast<int>(ops_.size());
  const int units = static_cast<int>(units_.size());
  for (int op : ops_) {
    if (op < 0 || op >= units) {
      return absl::InvalidArgumentError(
          absl::StrCat("model op uses unit ", op, "; the plan has ", units, " units"));
    }
  }
  std::vector<int> positions = ops_;
  for (int k = n - 1; k >= 0; --k) positions.push_back(ops_[k]);
  window_ = GatherWindow(positions, options_.prefetch);
  first_backward_.assign(units, -1);
  last_backward_.assign(units, -1);
  for (int pos = n; pos < 2 * n; ++pos) {
    const int u = positions[pos];
    if (first_backward_[u] < 0) first_backward_[u] = pos;
    last_backward_[u] = pos;
  }
  return absl::OkStatus();
}

// Each engine thread binds to the backend's device before its first op.
void ZeroEngine::StartThreads() {
  gather_thread_ = std::make_unique<TaskThread>("gather");
  reduce_thread_ = std::make_unique<TaskThread>("reduce");
  // DiLoCo: the compute thread's outer steps, but streaming fragments' there.
  if ((per_step_replicas() && options_.replica_thread) || streaming_outer()) {
    replica_thread_ = std::make_unique<TaskThread>("replicas");
  }
  Backend* backend = backend_;
  backend->BindThread();
  for (TaskThread* t : {gather_thread_.get(), reduce_thread_.get(), replica_thread_.get()}) {
    if (t == nullptr) continue;
    t->Submit([backend] {
      backend->BindThread();
      return absl::OkStatus();
    });
  }
}

ZeroEngine::~ZeroEngine() {
  gather_thread_.reset();
  reduce_thread_.reset();  // its tasks may queue work on the replica thread
  replica_thread_.reset();
  slots_.clear();  // releases shared gathers
  memory_.Sub(MemoryCategory::kCommBuffers, shared_gather_bytes_);
  for (auto& s : state_) {
    if (s && s->optimizer) memory_.Sub(MemoryCategory::kOptimizerState, s->optimizer->StateBytes());
  }
}

// ---- The pass ----

UnitTensors ZeroEngine::UnitViews(int unit, float* flat) const {
  return UnitViewsAt(unit, flat, units_[unit].tensor_offsets);
}

UnitTensors ZeroEngine::UnitViewsAt(int unit, float* base,
                                    const std::vector<int64_t>& offsets) const {
  const UnitLayout& layout = units_[unit];
  UnitTensors out(layout.tensors.size());
  for (size_t t = 0; t < layout.tensors.size(); ++t) {
    out[t].data = base + offsets[t];
    out[t].shape = layout.tensors[t].shape;
  }
  return out;
}

absl::StatusOr<double> ZeroEngine::ForwardBackward(bool last_micro) {
  if (absl::Status s = Pass(last_micro, /*pad=*/false); !s.ok()) return s;
  // Read after the backward pass (which does not change it): on a device,
  // reading the loss waits for the GPU, which mid-pass would stall it.
  const double loss = model_->Loss();
  loss_sum_ += loss;
  micro_batches_++;
  return loss;
}

absl::Status ZeroEngine::PadMicroBatch(bool last_micro) {
  // Without the step's count, the reductions average over ranks and a
  // padding pass's zeros would dilute the step's gradient.
  if (options_.global_micro_batches <= 0) {
    return absl::FailedPreconditionError(
        "PadMicroBatch: padding passes are for steps whose ranks train different numbers of "
        "micro-batches; set EngineOptions::global_micro_batches to the step's count");
  }
  return Pass(last_micro, /*pad=*/true);
}

absl::Status ZeroEngine::Pass(bool last_micro, bool pad) {
  // Phase order: the passes of one step, the last one marked, then Step
  // (worker.cc's RunStep; engine.h).
  assert(!step_pending_ && "a pass after the step's last one: Step first");
  assert(passes_ < options_.grad_accum && last_micro == (passes_ + 1 == options_.grad_accum) &&
         "the last pass is pass grad_accum");
  const int n = static_cast<int>(ops_.size());
  for (int k = 0; k < n; ++k) {
    absl::StatusOr<float*> params = AcquireParams(k, 2 * n - 1);
    if (!params.ok()) return params.status();
    if (!pad) {
      absl::Time start = absl::Now();
      absl::Status s = model_->Forward(k, UnitViews(ops_[k], *params));
      times_.forward_ms += MsSince(start);
      if (!s.ok()) return s;
      memory_.Set(MemoryCategory::kActivations, model_->ActivationBytes());
    }
    ReleaseParams(k);
  }
  for (int j = 0; j < n; ++j) {
    if (absl::Status s = BackwardPosition(j, last_micro, pad); !s.ok()) return s;
  }
  if (!pad) memory_.Set(MemoryCategory::kActivations, model_->ActivationBytes());
  assert(slots_.empty() && "every position of the pass released its unit");
  slots_.clear();
  passes_++;
  step_pending_ = last_micro;
  return absl::OkStatus();
}

absl::Status ZeroEngine::BackwardPosition(int j, bool last_micro, bool pad) {
  const int n = static_cast<int>(ops_.size());
  const int op = n - 1 - j, pos = n + j, unit = ops_[op];
  UnitState& state = *state_[unit];
  absl::StatusOr<float*> params = AcquireParams(pos, 2 * n - 1);
  if (!params.ok()) return params.status();
  float* grads = state.grads.f32();
  // The first backward op of a unit in a micro-batch writes its gradient
  // (no clearing pass) into a fresh buffer (stages 2-3) or, on the first
  // micro-batch, into the step's flat gradient (stages 0-1); later ones add.
  // A padding pass computes nothing: stages 2-3 reduce a zeroed buffer;
  // stages 0-1 leave the step's flat gradient as the rank's micro-batches
  // made it (zeroed if none did).
  Model::GradMode mode = Model::GradMode::kAdd;
  const std::vector<int64_t>& in_shard = backward_into_shard_[unit];
  if (!in_shard.empty()) {
    // A group of one: straight into the gradient shard, written by the
    // step's first micro-batch (whatever it held is stale: Step drained the
    // reductions that read it) and added to by the later ones.
    if (pos == first_backward_[unit] && passes_ == 0) {
      mode = Model::GradMode::kOverwrite;
      if (pad) backend_->Zero(state.grads.data(), state.grads.bytes());
    }
  } else if (stage_.grads_sharded) {
    if (pos == first_backward_[unit]) {
      assert(state.grads_flat.empty() && "a unit's flat gradient is lent once per micro-batch");
      const absl::Time wait_start = absl::Now();
      absl::StatusOr<TrackedBuffer> flat = LendWaiting(
          buffers_.flat_grads, MemoryCategory::kGradsTransient,
          Bytes(units_[unit].flat_elements, DType::kF32), /*zero=*/pad, reduce_thread_.get());
      times_.reduce_wait_ms += MsSince(wait_start);  // the reductions fell behind
      if (!flat.ok()) return flat.status();
      state.grads_flat = std::move(*flat);
      mode = Model::GradMode::kOverwrite;
    }
    grads = state.grads_flat.f32();
  } else if (state.grads_stale && pos == first_backward_[unit]) {
    mode = Model::GradMode::kOverwrite;
    if (pad) backend_->Zero(state.grads.data(), state.grads.bytes());
  }
  if (!stage_.grads_sharded) state.grads_stale = false;
  if (!pad) {
    UnitTensors grad_views =
        in_shard.empty() ? UnitViews(unit, grads) : UnitViewsAt(unit, grads, in_shard);
    absl::Time start = absl::Now();
    absl::Status s = model_->BackwardInto(op, UnitViews(unit, *params), grad_views, mode);
    times_.backward_ms += MsSince(start);
    if (!s.ok()) return s;
  }
  ReleaseParams(pos);
  if (pos != last_backward_[unit] || !(stage_.grads_sharded || last_micro)) {
    return absl::OkStatus();
  }
  // The task owns the flat gradient: the next micro-batch's backward of
  // this unit may start before the reduction has packed it.
  std::shared_ptr<Fence> computed = backend_->Record();
  // However the task ends (even skipped after an earlier failure), the
  // flat gradient goes back only after the backward that writes it.
  std::shared_ptr<TrackedBuffer> flat(new TrackedBuffer(std::move(state.grads_flat)),
                                      [computed](TrackedBuffer* buffer) {
                                        if (computed != nullptr) computed->Wait().IgnoreError();
                                        delete buffer;
                                      });
  reduce_thread_->Submit([this, unit, flat, computed, last_micro] {
    return ReduceUnit(unit, flat.get(), computed.get(), last_micro);
  });
  return absl::OkStatus();
}

absl::StatusOr<double> ZeroEngine::Forward() {
  const int n = static_cast<int>(ops_.size());
  // Evaluation between steps does not count toward the next step's times.
  const StepTimes saved_times = times_;
  absl::Cleanup restore_times = [this, saved_times] { times_ = saved_times; };
  for (int k = 0; k < n; ++k) {
    absl::StatusOr<float*> params = AcquireParams(k, n - 1);
    if (!params.ok()) return params.status();
    if (absl::Status s = model_->Forward(k, UnitViews(ops_[k], *params)); !s.ok()) return s;
    memory_.Set(MemoryCategory::kActivations, model_->ActivationBytes());
    // The last forward position would hand its unit to the (absent) backward.
    ReleaseParams(k, /*backward_follows=*/false);
  }
  assert(slots_.empty() && "every position of the pass released its unit");
  slots_.clear();
  return model_->Loss();
}

absl::StatusOr<TrackedBuffer> ZeroEngine::LendWaiting(BufferPool& pool, MemoryCategory category,
                                                      int64_t bytes, bool zero, TaskThread* giver) {
  // A collective that never returns fails after its timeout, and the tasks
  // after it are then skipped, giving their buffers back.
  const absl::Time deadline = absl::Now() + 2 * options_.collective_timeout + absl::Seconds(10);
  while (true) {
    absl::StatusOr<TrackedBuffer> buffer =
        pool.Lend(category, bytes, zero, /*wait=*/absl::Milliseconds(100));
    if (buffer.ok() || !absl::IsResourceExhausted(buffer.status())) return buffer;
    if (absl::Status s = giver->FirstError(); !s.ok()) return s;
    if (absl::Now() > deadline) return buffer.status();
  }
}

}  // namespace zeroshard
