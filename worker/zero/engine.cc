#include "worker/zero/engine.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <optional>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "common/checksum.h"
#include "common/shard_hash.h"
#include "worker/comm/quantized.h"

namespace zeroshard {

namespace {

int64_t Bytes(int64_t elements, DType dtype) { return elements * DTypeSize(dtype); }

double MsSince(absl::Time start) { return absl::ToDoubleMilliseconds(absl::Now() - start); }

char* At(void* base, int64_t element, DType dtype) {
  return static_cast<char*>(base) + element * DTypeSize(dtype);
}

}  // namespace

// Per unit. Which buffers exist depends on the stage (see engine.h).
struct ZeroEngine::UnitState {
  TrackedBuffer master;      // fp32 master: chunk (stages 1-3) or flat (stage 0, bf16 only)
  TrackedBuffer replicated;  // stages 0-2: flat, param dtype
  TrackedBuffer grads;       // stages 0-1: flat f32; stages 2-3: chunk f32 (accumulated shard)
  TrackedBuffer grads_flat;  // stages 2-3: flat f32 during this micro-batch's backward
  TrackedBuffer reduced;     // stage 1: chunk f32 after the step's reduce-scatter
  // `grads` holds nothing of this step yet (its contents are stale): the
  // first backward op (stages 0-1) or the first reduction (stages 2-3)
  // writes it instead of adding. Set by Step; cleared by the compute thread
  // (stages 0-1) or ReduceUnit (stages 2-3, which Step drains first).
  bool grads_stale = false;
  // Stages 2-3: sum of squares of `grads` after the step's last reduction
  // (taken by the reduce thread); unset when Step must compute it.
  std::optional<double> grad_squares;
  // Int8 reductions of this unit so far (reduce thread): with stochastic
  // rounding, each reduction's dither stream (QuantizedReduceRounding).
  int64_t quantized_reductions = 0;
  std::unique_ptr<Optimizer> optimizer;
  // hpZ: this rank's slice of the unit (UnitLayout::secondary_blocks), f32.
  // Written by gather tasks that keep it, read by the secondary gathers
  // (both on the gather thread, in issue order).
  TrackedBuffer secondary;
  // hpZ: a gather task issued so far writes `secondary` from the unit's
  // current parameters, so a gather task issued later may read it. Owned by
  // the compute thread: set when it issues such a gather, cleared when the
  // parameters change (UpdateUnit, Initialize).
  bool secondary_fresh = false;
};

// A unit gathered into a SharedGather region: released (and its bytes moved
// back from params_gathered to comm buffers) when the last holder drops it
// (a slot, or the gather task that fills it).
struct ZeroEngine::SharedLease {
  SharedGather* gather = nullptr;
  MemoryTracker* memory = nullptr;
  int64_t bytes = 0;
  const float* data = nullptr;  // set by the gather task
  int64_t ticket = 0;           // 0: not gathered
  ~SharedLease() {
    if (ticket == 0) return;
    gather->Release(ticket);
    memory->Sub(MemoryCategory::kParamsGathered, bytes);
    memory->Add(MemoryCategory::kCommBuffers, bytes);
  }
};

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

namespace {

absl::Status ValidateOptions(const EngineOptions& options, const ShardPlan& plan,
                             const Communicator* gather, const Communicator* reduce,
                             const Communicator* aux) {
  if (options.stage < 0 || options.stage > 3) {
    return absl::InvalidArgumentError(
        absl::StrCat("stage ", options.stage, " is not a ZeRO stage: expected 0, 1, 2 or 3"));
  }
  if (options.prefetch < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("prefetch ", options.prefetch, " must be >= 0"));
  }
  if (options.grad_accum < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("grad_accum ", options.grad_accum, " must be >= 1"));
  }
  if (options.param_dtype != DType::kF32 && options.param_dtype != DType::kBF16) {
    return absl::InvalidArgumentError(absl::StrCat(
        "param dtype ", DTypeName(options.param_dtype), " is not supported: expected f32 or bf16"));
  }
  if (options.reduce_dtype != DType::kF32 && options.reduce_dtype != DType::kBF16 &&
      options.reduce_dtype != DType::kI8) {
    return absl::InvalidArgumentError(absl::StrCat("reduce dtype ",
                                                   DTypeName(options.reduce_dtype),
                                                   " is not supported: expected f32, bf16 or int8"));
  }
  if (options.gather_dtype != DType::kF32 && options.gather_dtype != DType::kI8) {
    return absl::InvalidArgumentError(absl::StrCat(
        "gather dtype ", DTypeName(options.gather_dtype), " is not supported: expected f32 or int8"));
  }
  if (options.gather_dtype == DType::kI8 &&
      (options.stage != 3 || options.param_dtype != DType::kF32)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "int8 gathers quantize stage 3's f32 parameter gathers; this run has stage ",
        options.stage, " and param dtype ", DTypeName(options.param_dtype),
        ": use --stage=3 --param_dtype=f32, or --gather_dtype=f32"));
  }
  const bool int8 = options.gather_dtype == DType::kI8 || options.reduce_dtype == DType::kI8;
  if (int8 && options.backend != nullptr && !options.backend->host_accessible()) {
    return absl::InvalidArgumentError(
        absl::StrCat("int8 gathers and reductions run on host memory; backend '",
                     options.backend->name(), "' is not: use f32 or bf16 there"));
  }
  const int group = plan.options.ShardGroupSize(plan.world_size);
  if (gather->world_size() != group || reduce->world_size() != group ||
      aux->world_size() != plan.world_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the plan is for world size ", plan.world_size, " in shard groups of ", group,
        " but the communicators have ", gather->world_size(), " (gather), ",
        reduce->world_size(), " (reduce) and ", aux->world_size(), " (aux)"));
  }
  if (options.secondary != nullptr) {
    const int h = options.secondary->world_size();
    if (options.stage != 3) {
      return absl::InvalidArgumentError(absl::StrCat(
          "secondary shards (hpZ) serve stage 3's backward gathers; this run has stage ",
          options.stage, ": use --stage=3 or drop --secondary_shard_group_size"));
    }
    if (h >= group) {
      return absl::InvalidArgumentError(absl::StrCat(
          "secondary groups of ", h, " ranks (hpZ) must be smaller than the shard groups of ",
          group, " ranks the gathers run over; with groups that small hpZ saves nothing"));
    }
  }
  const int replicas = plan.world_size / group;
  if (replicas > 1) {
    if (options.replicas == nullptr || options.replicas->world_size() != replicas) {
      return absl::InvalidArgumentError(absl::StrCat(
          "the plan has ", replicas, " replicas of each shard (groups of ", group,
          ") but the replicas' communicator has ",
          options.replicas == nullptr ? 0 : options.replicas->world_size(), " ranks"));
    }
    if (options.stage == 0) {
      return absl::InvalidArgumentError(
          "stage 0 replicates every state already: shard groups need stage 1, 2 or 3");
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<ZeroEngine>> ZeroEngine::Create(Model* model,
                                                               const ShardPlan& plan,
                                                               Communicator* gather,
                                                               Communicator* reduce,
                                                               Communicator* aux,
                                                               const EngineOptions& options) {
  if (absl::Status s = ValidateOptions(options, plan, gather, reduce, aux); !s.ok()) return s;
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
  if (absl::Status s = engine->BuildLayouts(plan); !s.ok()) return s;
  engine->BuildSecondaryLayouts();
  if (absl::Status s = engine->BuildSchedule(); !s.ok()) return s;
  if (absl::Status s = engine->AllocateUnitStates(); !s.ok()) return s;
  if (absl::Status s = engine->SetUpSharedGather(); !s.ok()) return s;
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
      return absl::InvalidArgumentError(absl::StrCat("model op uses unit ", op, "; the plan has ",
                                                     units, " units"));
    }
  }
  positions_ = ops_;
  for (int k = n - 1; k >= 0; --k) positions_.push_back(ops_[k]);
  first_backward_.assign(units, -1);
  last_backward_.assign(units, -1);
  for (int pos = n; pos < 2 * n; ++pos) {
    const int u = positions_[pos];
    if (first_backward_[u] < 0) first_backward_[u] = pos;
    last_backward_[u] = pos;
  }
  return absl::OkStatus();
}

// Buffers and optimizers, by stage.
absl::Status ZeroEngine::AllocateUnitStates() {
  const StageTraits stage = stage_;
  const bool bf16_params = options_.param_dtype == DType::kBF16;
  MemoryTracker* m = &memory_;
  for (const UnitLayout& layout : units_) {
    auto state = std::make_unique<UnitState>();
    const int64_t flat = layout.flat_elements, chunk = layout.chunk_elements;
    if (stage.params_sharded) {
      state->master = TrackedBuffer(m, MemoryCategory::kParamsSharded, Bytes(chunk, DType::kF32));
      state->grads = TrackedBuffer(m, MemoryCategory::kGradsPersistent, Bytes(chunk, DType::kF32));
    } else {
      state->replicated = TrackedBuffer(m, MemoryCategory::kParamsReplicated,
                                        Bytes(flat, options_.param_dtype));
      if (bf16_params) {
        state->master = TrackedBuffer(m, MemoryCategory::kParamsSharded,
                                      Bytes(!stage.state_sharded ? flat : chunk, DType::kF32));
      }
      state->grads = TrackedBuffer(m, MemoryCategory::kGradsPersistent,
                                   Bytes(!stage.grads_sharded ? flat : chunk, DType::kF32));
    }
    if (secondary_comm_ != nullptr) {
      state->secondary = TrackedBuffer(m, MemoryCategory::kParamsSecondary,
                                       Bytes(layout.secondary_elements, DType::kF32));
    }
    auto optimizer = backend_->MakeOptimizer(
        options_.optimizer, !stage.state_sharded ? flat : chunk, options_.optimizer_options);
    if (!optimizer.ok()) return optimizer.status();
    state->optimizer = std::move(*optimizer);
    m->Add(MemoryCategory::kOptimizerState, state->optimizer->StateBytes());
    state_.push_back(std::move(state));
  }
  return absl::OkStatus();
}

// Stage 3, f32 on the host: every rank writes its pieces once into a region
// all ranks read in place. Regions: the 1 + prefetch units of the window and
// one more, since a region is reused only once every gather before it has
// been released (units kept for the backward are released out of gather
// order).
absl::Status ZeroEngine::SetUpSharedGather() {
  if (!stage_.params_sharded || !options_.shared_gather ||
      options_.param_dtype == DType::kBF16 || options_.gather_dtype == DType::kI8 ||
      !backend_->host_accessible()) {
    return absl::OkStatus();
  }
  const int regions = options_.prefetch + 2;
  const int64_t region_bytes = Bytes(largest_unit_elements(), DType::kF32);
  absl::StatusOr<SharedGather*> shared =
      gather_comm_->MakeSharedGather(regions, region_bytes, options_.collective_timeout);
  if (!shared.ok()) {
    return absl::Status(shared.status().code(),
                        absl::StrCat("setting up shared gathers: ", shared.status().message()));
  }
  shared_gather_ = *shared;
  if (*shared != nullptr) {
    shared_gather_bytes_ = int64_t{(*shared)->regions()} * (*shared)->region_bytes();
    memory_.Add(MemoryCategory::kCommBuffers, shared_gather_bytes_);
  }
  return absl::OkStatus();
}

// Each engine thread binds to the backend's device before its first op.
void ZeroEngine::StartThreads() {
  gather_thread_ = std::make_unique<TaskThread>("gather");
  reduce_thread_ = std::make_unique<TaskThread>("reduce");
  if (replica_comm_ != nullptr && options_.replica_thread) {
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

namespace {

// Shard groups: the replicas' runs of one group-plan piece lie back to back
// in the member's chunk and in the tensor's rows; joined again they are
// that piece (one block per piece in the group's collectives).
std::vector<Segment> JoinReplicaRuns(std::vector<Segment> runs) {
  std::sort(runs.begin(), runs.end(), [](const Segment& a, const Segment& b) {
    return a.rank != b.rank ? a.rank < b.rank : a.chunk_offset < b.chunk_offset;
  });
  std::vector<Segment> joined;
  for (const Segment& s : runs) {
    if (!joined.empty()) {
      Segment& last = joined.back();
      if (last.rank == s.rank && last.tensor == s.tensor && last.row_end == s.row_begin &&
          last.chunk_offset + last.length == s.chunk_offset) {
        last.row_end = s.row_end;
        last.length += s.length;
        continue;
      }
    }
    joined.push_back(s);
  }
  return joined;
}

}  // namespace

absl::Status ZeroEngine::BuildLayouts(const ShardPlan& plan) {
  const ModelSpec& spec = model_->Spec();
  // Units by name, as the model labels them, in first-appearance order.
  std::vector<std::string> unit_names;
  std::map<std::string, std::vector<const TensorSpec*>> model_units;
  for (const TensorSpec& t : spec.tensors) {
    if (!model_units.count(t.unit)) unit_names.push_back(t.unit);
    model_units[t.unit].push_back(&t);
  }
  if (plan.units.size() != unit_names.size()) {
    return absl::InvalidArgumentError(absl::StrCat("the plan has ", plan.units.size(),
                                                   " units; the model has ", unit_names.size()));
  }
  for (size_t u = 0; u < plan.units.size(); ++u) {
    const ShardUnit& pu = plan.units[u];
    const auto& tensors = model_units[unit_names[u]];
    if (pu.name != unit_names[u] || pu.tensors.size() != tensors.size()) {
      return absl::InvalidArgumentError(absl::StrCat("plan unit ", u, " is '", pu.name,
                                                     "' with ", pu.tensors.size(),
                                                     " tensors; the model's is '", unit_names[u],
                                                     "' with ", tensors.size()));
    }
    UnitLayout layout;
    layout.name = pu.name;
    layout.chunk_elements = pu.chunk_elements;
    for (size_t t = 0; t < tensors.size(); ++t) {
      if (pu.tensors[t].name != tensors[t]->name || pu.tensors[t].shape != tensors[t]->shape) {
        return absl::InvalidArgumentError(absl::StrCat(
            "plan tensor '", pu.tensors[t].name, "' does not match the model's tensor '",
            tensors[t]->name, "' (name or shape differ)"));
      }
      layout.tensors.push_back(*tensors[t]);
      layout.tensor_offsets.push_back(layout.flat_elements);
      layout.flat_elements += tensors[t]->Elements();
    }
    // Segments by group member (the rank itself without groups).
    std::vector<Segment> segments;
    for (const Piece& p : pu.pieces) {
      const TensorSpec& t = layout.tensors[p.tensor];
      Segment s;
      s.rank = p.rank % group_size_;
      s.chunk_offset = p.offset;
      s.tensor = p.tensor;
      s.row_begin = p.row_begin;
      s.row_end = p.row_end;
      s.flat_offset = layout.tensor_offsets[p.tensor] + p.row_begin * t.RowElements();
      s.length = (p.row_end - p.row_begin) * t.RowElements();
      if (p.rank == rank_) layout.saved.push_back(s);
      if (p.rank == replica_peer()) layout.replica_peer_saved.push_back(s);
      segments.push_back(s);
    }
    if (group_size_ < world_) segments = JoinReplicaRuns(std::move(segments));
    for (const Segment& s : segments) {
      if (s.rank == rank_ % group_size_) {
        layout.own_segments.push_back(static_cast<int>(layout.segments.size()));
      }
      layout.segments.push_back(s);
      layout.blocks.push_back(ShardBlock{s.rank, s.chunk_offset, s.flat_offset, s.length});
    }
    units_.push_back(std::move(layout));
  }
  return absl::OkStatus();
}

// An even split of the flat layout: the slices are contiguous ranges, cut
// from the gathered unit with one copy and gathered back with one block each.
void ZeroEngine::BuildSecondaryLayouts() {
  if (secondary_comm_ == nullptr) return;
  const int h = secondary_comm_->world_size();
  for (UnitLayout& u : units_) {
    u.secondary_elements = (u.flat_elements + h - 1) / h;
    for (int m = 0; m < h; ++m) {
      const int64_t begin = m * u.secondary_elements;
      const int64_t count = std::min(u.secondary_elements, u.flat_elements - begin);
      if (count > 0) u.secondary_blocks.push_back(ShardBlock{m, 0, begin, count});
    }
  }
}

int64_t ZeroEngine::largest_unit_elements() const {
  int64_t largest = 0;
  for (const UnitLayout& u : units_) largest = std::max(largest, u.flat_elements);
  return largest;
}

void ZeroEngine::PackOwn(const UnitLayout& u, const float* flat, float* chunk) const {
  backend_->Zero(chunk, u.chunk_elements * sizeof(float));
  for (int i : u.own_segments) {
    const Segment& s = u.segments[i];
    backend_->Copy(chunk + s.chunk_offset, flat + s.flat_offset, s.length * sizeof(float));
  }
}

absl::Status ZeroEngine::FillRows(const RowSource& fill, const TensorSpec& tensor,
                                  int64_t row_begin, int64_t row_end, float* target) {
  if (backend_->host_accessible()) return fill(tensor, row_begin, row_end, target);
  std::vector<float> host((row_end - row_begin) * tensor.RowElements());
  if (absl::Status s = fill(tensor, row_begin, row_end, host.data()); !s.ok()) return s;
  return backend_->CopyFromHost(target, host.data(), host.size() * sizeof(float));
}

absl::Status ZeroEngine::Initialize(const RowSource& fill) {
  ReleaseHeldParameters();
  const bool bf16_params = options_.param_dtype == DType::kBF16;
  // Gathers a Step issued early would read the values about to be replaced.
  if (absl::Status s = gather_thread_->Drain(); !s.ok()) return s;
  slots_.clear();
  for (size_t u = 0; u < units_.size(); ++u) {
    const UnitLayout& layout = units_[u];
    UnitState& state = *state_[u];
    state.secondary_fresh = false;  // rebuilt by the next forward's gather
    if (stage_.params_sharded) {
      for (int i : layout.own_segments) {
        const Segment& s = layout.segments[i];
        absl::Status st = FillRows(fill, layout.tensors[s.tensor], s.row_begin, s.row_end,
                                   state.master.f32() + s.chunk_offset);
        if (!st.ok()) return st;
      }
      continue;
    }
    // Stages 0-2 hold every row: f32 in a temporary, then the replicated
    // parameters (param dtype) and, with bf16, the f32 master.
    TrackedBuffer flat(&memory_, MemoryCategory::kCommBuffers,
                       Bytes(layout.flat_elements, DType::kF32), /*zero=*/false);
    for (size_t t = 0; t < layout.tensors.size(); ++t) {
      absl::Status st = FillRows(fill, layout.tensors[t], 0, layout.tensors[t].Rows(),
                                 flat.f32() + layout.tensor_offsets[t]);
      if (!st.ok()) return st;
    }
    backend_->Convert(flat.data(), DType::kF32, state.replicated.data(), options_.param_dtype,
                      layout.flat_elements);
    if (bf16_params) {
      if (!stage_.state_sharded) {
        backend_->Copy(state.master.data(), flat.data(), flat.bytes());
      } else {
        PackOwn(layout, flat.f32(), state.master.f32());
      }
    }
  }
  return backend_->Synchronize();
}

absl::Status ZeroEngine::InitializeMoment(Moment moment, const RowSource& fill) {
  for (size_t u = 0; u < units_.size(); ++u) {
    const UnitLayout& layout = units_[u];
    Optimizer& opt = *state_[u]->optimizer;
    float* target = moment == Moment::kExpAvg ? opt.exp_avg() : opt.exp_avg_sq();
    if (target == nullptr) {
      return absl::FailedPreconditionError(absl::StrCat(
          "optimizer '", opt.name(), "' keeps no ",
          moment == Moment::kExpAvg ? "exp_avg" : "exp_avg_sq", " state to load"));
    }
    if (!stage_.state_sharded) {  // replicated: every row, flat layout
      for (size_t t = 0; t < layout.tensors.size(); ++t) {
        absl::Status st = FillRows(fill, layout.tensors[t], 0, layout.tensors[t].Rows(),
                                   target + layout.tensor_offsets[t]);
        if (!st.ok()) return st;
      }
      continue;
    }
    for (int i : layout.own_segments) {
      const Segment& s = layout.segments[i];
      absl::Status st =
          FillRows(fill, layout.tensors[s.tensor], s.row_begin, s.row_end, target + s.chunk_offset);
      if (!st.ok()) return st;
    }
  }
  return backend_->Synchronize();
}

// ---- Stage 3 gathers ----

absl::Status ZeroEngine::GatherUnit(int unit, TrackedBuffer* out, bool keep_secondary) {
  const UnitLayout& layout = units_[unit];
  UnitState& state = *state_[unit];
  const DType dtype = options_.param_dtype;
  const int64_t chunk = layout.chunk_elements;
  if (options_.gather_dtype == DType::kI8) {
    EnterCollective(kGatherStream, "all_gather", layout.name);
    absl::Status s = QuantizedAllGatherBlocks(gather_comm_, state.master.f32(), out->f32(),
                                              layout.blocks, options_.collective_timeout);
    LeaveCollective(kGatherStream);
    if (!s.ok()) {
      return absl::Status(s.code(),
                          absl::StrCat("all_gather (int8) of ", Where(unit), ": ", s.message()));
    }
    if (keep_secondary) KeepSecondarySlice(unit, out->f32());
    return absl::OkStatus();
  }
  // f32: the pieces land straight in the unit's flat buffer. bf16: they
  // travel as bf16 and are widened once.
  TrackedBuffer send, received;
  const void* input = state.master.data();
  void* output = out->data();
  if (dtype != DType::kF32) {
    send = TrackedBuffer(&memory_, MemoryCategory::kCommBuffers, Bytes(chunk, dtype),
                         /*zero=*/false);
    backend_->Convert(state.master.data(), DType::kF32, send.data(), dtype, chunk);
    input = send.data();
    received = TrackedBuffer(&memory_, MemoryCategory::kCommBuffers,
                             Bytes(layout.flat_elements, dtype), /*zero=*/false);
    output = received.data();
    if (absl::Status s = backend_->Synchronize(); !s.ok()) return s;
  }
  EnterCollective(kGatherStream, "all_gather", layout.name);
  absl::Status s = gather_comm_->AllGatherBlocks(input, output, layout.blocks, dtype,
                                                 options_.collective_timeout);
  LeaveCollective(kGatherStream);
  if (!s.ok()) {
    return absl::Status(s.code(), absl::StrCat("all_gather of ", Where(unit), ": ", s.message()));
  }
  if (dtype != DType::kF32) {
    backend_->Convert(received.data(), dtype, out->data(), DType::kF32, layout.flat_elements);
  }
  if (keep_secondary) KeepSecondarySlice(unit, out->f32());
  return backend_->Synchronize();  // the compute thread reads it next
}

void ZeroEngine::KeepSecondarySlice(int unit, const float* flat) {
  const UnitLayout& layout = units_[unit];
  const int member = secondary_comm_->rank();
  for (const ShardBlock& b : layout.secondary_blocks) {
    if (b.rank != member) continue;
    backend_->Copy(state_[unit]->secondary.f32() + b.shard_offset, flat + b.full_offset,
                   b.count * sizeof(float));
  }
}

absl::Status ZeroEngine::GatherUnitFromSecondary(int unit, TrackedBuffer* out) {
  const UnitLayout& layout = units_[unit];
  EnterCollective(kGatherStream, "all_gather", layout.name);
  absl::Status s = secondary_comm_->AllGatherBlocks(state_[unit]->secondary.data(), out->data(),
                                                    layout.secondary_blocks, DType::kF32,
                                                    options_.collective_timeout);
  LeaveCollective(kGatherStream);
  if (!s.ok()) {
    return absl::Status(s.code(), absl::StrCat("all_gather from the secondary shards (hpZ) of ",
                                               Where(unit), ": ", s.message()));
  }
  return backend_->Synchronize();
}

absl::Status ZeroEngine::GatherUnitShared(int unit, SharedLease* lease, bool keep_secondary) {
  const UnitLayout& layout = units_[unit];
  EnterCollective(kGatherStream, "all_gather", layout.name);
  absl::StatusOr<SharedGather::Result> r = shared_gather_->Gather(
      state_[unit]->master.data(), layout.blocks, DType::kF32, options_.collective_timeout);
  LeaveCollective(kGatherStream);
  if (!r.ok()) {
    return absl::Status(r.status().code(),
                        absl::StrCat("all_gather of ", Where(unit), ": ", r.status().message()));
  }
  lease->data = static_cast<const float*>(r->full);
  lease->ticket = r->ticket;
  if (keep_secondary) KeepSecondarySlice(unit, lease->data);
  memory_.Sub(MemoryCategory::kCommBuffers, lease->bytes);
  memory_.Add(MemoryCategory::kParamsGathered, lease->bytes);
  return absl::OkStatus();
}

absl::Status ZeroEngine::IssueGather(int position) {
  auto& slots = slots_;
  if (slots.count(position)) return absl::OkStatus();
  int unit = positions_[position];
  GatherSlot& slot = slots[position];
  if (position > 0 && positions_[position - 1] == unit) {
    slot.ticket = 0;  // the previous position keeps its buffer for us
    return absl::OkStatus();
  }
  // hpZ: the backward reads the secondary slices when they hold the unit's
  // current parameters; every other gather refreshes them (the gather
  // thread runs tasks in issue order, so later tasks see the slice).
  UnitState& state = *state_[unit];
  const bool from_secondary =
      secondary_comm_ != nullptr && position >= static_cast<int>(ops_.size()) &&
      state.secondary_fresh;
  const bool keep_secondary = secondary_comm_ != nullptr && !from_secondary;
  if (keep_secondary) state.secondary_fresh = true;
  if (shared_gather_ != nullptr && !from_secondary) {
    auto lease = std::make_shared<SharedLease>();
    lease->gather = shared_gather_;
    lease->memory = &memory_;
    lease->bytes = Bytes(units_[unit].flat_elements, DType::kF32);
    slot.shared = lease;
    slot.ticket = gather_thread_->Submit([this, unit, lease, keep_secondary]() {
      return GatherUnitShared(unit, lease.get(), keep_secondary);
    });
    return absl::OkStatus();
  }
  // Every element is written by the unpacking (the pieces cover the unit).
  slot.params = TrackedBuffer(&memory_, MemoryCategory::kParamsGathered,
                              Bytes(units_[unit].flat_elements, DType::kF32), /*zero=*/false);
  TrackedBuffer* out = &slot.params;
  // On a device the block may still be read by this thread's queued work
  // (a released unit); the gather writes it only after that.
  std::shared_ptr<Fence> free_to_write = backend_->Record();
  slot.ticket = gather_thread_->Submit(
      [this, unit, out, free_to_write, from_secondary, keep_secondary]() -> absl::Status {
        if (free_to_write != nullptr) {
          if (absl::Status s = free_to_write->Wait(); !s.ok()) return s;
        }
        if (from_secondary) return GatherUnitFromSecondary(unit, out);
        return GatherUnit(unit, out, keep_secondary);
      });
  return absl::OkStatus();
}

absl::Status ZeroEngine::HoldGatheredParameters() {
  if (!stage_.params_sharded || !held_.empty()) return absl::OkStatus();
  // Gathers a Step issued early may be in flight: they finish first.
  if (absl::Status s = gather_thread_->Drain(); !s.ok()) return s;
  slots_.clear();
  std::vector<TrackedBuffer> held;
  for (size_t u = 0; u < units_.size(); ++u) {
    held.emplace_back(&memory_, MemoryCategory::kParamsGathered,
                      Bytes(units_[u].flat_elements, DType::kF32), /*zero=*/false);
    if (absl::Status s = GatherUnit(static_cast<int>(u), &held.back()); !s.ok()) return s;
  }
  held_ = std::move(held);
  return absl::OkStatus();
}

void ZeroEngine::ReleaseHeldParameters() { held_.clear(); }

absl::StatusOr<float*> ZeroEngine::AcquireParams(int position, int last_position) {
  int unit = positions_[position];
  if (!held_.empty()) return held_[unit].f32();
  if (!stage_.params_sharded) {
    UnitState& state = *state_[unit];
    if (options_.param_dtype == DType::kF32) return state.replicated.f32();
    auto& slots = slots_;
    GatherSlot& slot = slots[position];
    slot.params = TrackedBuffer(&memory_, MemoryCategory::kParamsGathered,
                                Bytes(units_[unit].flat_elements, DType::kF32));
    backend_->Convert(state.replicated.data(), options_.param_dtype, slot.params.data(),
                      DType::kF32, units_[unit].flat_elements);
    return slot.params.f32();
  }
  const int n = static_cast<int>(ops_.size());
  const int depth = position < n ? options_.prefetch : std::min(options_.prefetch, 1);
  for (int p = position; p <= std::min(position + depth, last_position); ++p) {
    if (absl::Status s = IssueGather(p); !s.ok()) return s;
  }
  auto& slots = slots_;
  GatherSlot& slot = slots[position];
  if (slot.ticket != 0) {
    absl::Time start = absl::Now();
    absl::Status s = gather_thread_->Wait(slot.ticket);
    times_.gather_wait_ms += MsSince(start);
    if (!s.ok()) return s;
  }
  // The model reads parameters only: a shared region is never written here.
  if (slot.shared != nullptr) return const_cast<float*>(slot.shared->data);
  return slot.params.f32();
}

void ZeroEngine::ReleaseParams(int position, bool backward_follows) {
  auto& slots = slots_;
  auto it = slots.find(position);
  if (it == slots.end()) return;
  const int n = static_cast<int>(ops_.size());
  const int end = backward_follows ? static_cast<int>(positions_.size()) : n;
  if (stage_.params_sharded) {
    int next = -1;
    if (position + 1 < end && positions_[position + 1] == positions_[position]) {
      // The same unit is needed next: hand the buffer over instead of
      // regathering (IssueGather left that position's slot empty for it).
      next = position + 1;
    } else if (backward_follows && position < n - 1 && position >= n - 1 - options_.prefetch) {
      // One of the last `prefetch` forward positions: its backward mirror
      // 2n - 1 - position is reached within the prefetch window, so keeping
      // the unit costs no more memory than gathering it again would.
      next = 2 * n - 1 - position;
    }
    // A mirror position is gathered only after this release, so its slot
    // does not exist yet; never replace a slot with a gather in flight.
    if (next == position + 1 || (next >= 0 && !slots.count(next))) {
      slots[next].params = std::move(it->second.params);
      slots[next].shared = std::move(it->second.shared);
      slots[next].ticket = 0;
    }
  }
  slots.erase(position);
}

// ---- Reductions ----

// The rounding of this unit's next int8 reduction: to nearest, or
// stochastic (EngineOptions::int8_stochastic_reduce) with a seed of its
// own, (unit, count), the same on every rank; the quantizers mix in the
// rank and destination. Reduce thread only.
Int8Rounding ZeroEngine::QuantizedReduceRounding(int unit) {
  const int64_t count = state_[unit]->quantized_reductions++;
  return Int8Rounding{options_.int8_stochastic_reduce,
                      (static_cast<uint64_t>(unit) << 40) ^ static_cast<uint64_t>(count)};
}

// Stage 0: all-reduce the unit's full gradient (average over ranks), in
// place (bf16: through a narrowed copy).
absl::Status ZeroEngine::AllReduceUnit(int unit) {
  const UnitLayout& layout = units_[unit];
  UnitState& state = *state_[unit];
  const DType dtype = options_.reduce_dtype;
  const int64_t flat = layout.flat_elements;
  EnterCollective(kReduceStream, "all_reduce", layout.name);
  absl::Status s;
  if (dtype == DType::kF32) {
    s = reduce_comm_->AllReduce(state.grads.data(), flat, dtype, ReduceOp::kAverage,
                                options_.collective_timeout);
  } else if (dtype == DType::kI8) {
    s = QuantizedAllReduce(reduce_comm_, state.grads.f32(), flat, ReduceOp::kAverage,
                           options_.collective_timeout, QuantizedReduceRounding(unit));
  } else {
    TrackedBuffer buffer(&memory_, MemoryCategory::kCommBuffers, Bytes(flat, dtype),
                         /*zero=*/false);
    backend_->Convert(state.grads.data(), DType::kF32, buffer.data(), dtype, flat);
    s = backend_->Synchronize();
    if (s.ok()) {
      s = reduce_comm_->AllReduce(buffer.data(), flat, dtype, ReduceOp::kAverage,
                                  options_.collective_timeout);
    }
    if (s.ok()) backend_->Convert(buffer.data(), dtype, state.grads.data(), DType::kF32, flat);
  }
  LeaveCollective(kReduceStream);
  if (!s.ok()) {
    return absl::Status(s.code(), absl::StrCat("all_reduce of ", Where(unit), ": ", s.message()));
  }
  return backend_->Synchronize();
}

// Shard groups: the group's average of this member's gradient shard,
// averaged again over the replicas (in place, whole chunk; padding is zero):
// the average over all W ranks. Ring all-reduce (and int8's all-gather,
// summed in rank order) leaves every replica the same bits, so the
// replicas' optimizer steps stay equal. `chunk` holds `dtype`, f32 for int8.
absl::Status ZeroEngine::AverageOverReplicas(int unit, void* chunk, DType dtype,
                                             Int8Rounding rounding) {
  const UnitLayout& layout = units_[unit];
  EnterCollective(kReplicaStream, "all_reduce", layout.name);
  absl::Status s =
      dtype == DType::kI8
          ? QuantizedAllReduce(replica_comm_, static_cast<float*>(chunk), layout.chunk_elements,
                               ReduceOp::kAverage, options_.collective_timeout, rounding)
          : replica_comm_->AllReduce(chunk, layout.chunk_elements, dtype, ReduceOp::kAverage,
                                     options_.collective_timeout);
  LeaveCollective(kReplicaStream);
  if (!s.ok()) {
    return absl::Status(s.code(), absl::StrCat("all_reduce over the replicas of ", Where(unit),
                                               ": ", s.message()));
  }
  return absl::OkStatus();
}

absl::Status ZeroEngine::ReduceUnit(int unit, TrackedBuffer* grads_flat_buffer, Fence* computed,
                                    bool last_micro) {
  // The compute thread's backward of this unit must be done.
  if (computed != nullptr) {
    if (absl::Status s = computed->Wait(); !s.ok()) return s;
  }
  const UnitLayout& layout = units_[unit];
  UnitState& state = *state_[unit];
  // On the wire inside the group (int8 inside a host's shared memory: f32,
  // EngineOptions::int8_group_reduce_in_f32); the replicas' all-reduce
  // travels in options_.reduce_dtype.
  const DType dtype = options_.reduce_dtype == DType::kI8 && options_.int8_group_reduce_in_f32
                          ? DType::kF32
                          : options_.reduce_dtype;
  // In the buffers: int8 reductions take and give f32.
  const DType held = dtype == DType::kI8 ? DType::kF32 : dtype;
  const int64_t chunk = layout.chunk_elements;
  const int64_t flat = layout.flat_elements;
  if (!stage_.state_sharded) return AllReduceUnit(unit);
  // Stages 1-3: reduce-scatter the flat gradient straight from the flat
  // layout (bf16: from a narrowed copy) into this rank's pieces.
  const float* grads_flat = stage_.reduce_at_step ? state.grads.f32() : grads_flat_buffer->f32();
  const void* input = grads_flat;
  TrackedBuffer narrowed;
  if (held != DType::kF32) {
    narrowed = TrackedBuffer(&memory_, MemoryCategory::kCommBuffers, Bytes(flat, held),
                             /*zero=*/false);
    backend_->Convert(grads_flat, DType::kF32, narrowed.data(), held, flat);
    input = narrowed.data();
  }
  // Only this rank's pieces are written, and only they are read below. The
  // first f32 reduction of a step lands straight in the gradient shard.
  const bool direct = stage_.grads_sharded && state.grads_stale && held == DType::kF32;
  TrackedBuffer received;
  if (!direct) {
    // The replicas' all-reduce adds whole chunks: padding must hold zeros.
    received = TrackedBuffer(&memory_, MemoryCategory::kCommBuffers, Bytes(chunk, held),
                             /*zero=*/replica_comm_ != nullptr);
  }
  // The conversion, and the allocations (a device block may come back from
  // another stream's free), are done before the communicator's stream
  // touches them.
  if (absl::Status s = backend_->Synchronize(); !s.ok()) return s;
  if (held != DType::kF32 && stage_.grads_sharded) grads_flat_buffer->Reset();
  EnterCollective(kReduceStream, "reduce_scatter", layout.name);
  void* output = direct ? state.grads.data() : received.data();
  // Int8: the group's reduce-scatter and the replicas' all-reduce draw
  // from two streams of this reduction's seed.
  const Int8Rounding rounding =
      options_.reduce_dtype == DType::kI8 ? QuantizedReduceRounding(unit) : Int8Rounding{};
  Int8Rounding replica_rounding = rounding;
  replica_rounding.seed ^= uint64_t{1} << 63;
  absl::Status s =
      dtype == DType::kI8
          ? QuantizedReduceScatterBlocks(reduce_comm_, static_cast<const float*>(input),
                                         static_cast<float*>(output), layout.blocks,
                                         ReduceOp::kAverage, options_.collective_timeout, rounding)
          : reduce_comm_->ReduceScatterBlocks(input, output, layout.blocks, dtype,
                                              ReduceOp::kAverage, options_.collective_timeout);
  LeaveCollective(kReduceStream);
  if (stage_.grads_sharded) grads_flat_buffer->Reset();
  narrowed.Reset();
  if (!s.ok()) {
    return absl::Status(s.code(),
                        absl::StrCat("reduce_scatter of ", Where(unit), ": ", s.message()));
  }
  // Decided here, on the reduce thread, before the next micro-batch's
  // reduction of this unit looks at it.
  const bool stale = state.grads_stale;
  if (stage_.grads_sharded) state.grads_stale = false;  // stage 1: the compute thread's
  if (replica_comm_ == nullptr) {
    return FinishReduction(unit, &received, direct, stale, last_micro);
  }
  if (replica_thread_ == nullptr) {
    if (absl::Status s =
            AverageOverReplicas(unit, output, options_.reduce_dtype, replica_rounding);
        !s.ok()) {
      return s;
    }
    return FinishReduction(unit, &received, direct, stale, last_micro);
  }
  // The replicas' average and the rest on the replica thread, in order; the
  // reduce thread goes on with the next unit inside the group meanwhile.
  auto held_chunk = std::make_shared<TrackedBuffer>(std::move(received));
  replica_thread_->Submit([this, unit, held_chunk, direct, stale, last_micro,
                           replica_rounding]() -> absl::Status {
    void* data = direct ? state_[unit]->grads.data() : held_chunk->data();
    if (absl::Status s =
            AverageOverReplicas(unit, data, options_.reduce_dtype, replica_rounding);
        !s.ok()) {
      return s;
    }
    return FinishReduction(unit, held_chunk.get(), direct, stale, last_micro);
  });
  return absl::OkStatus();
}

absl::Status ZeroEngine::FinishReduction(int unit, TrackedBuffer* received, bool direct,
                                         bool stale, bool last_micro) {
  const UnitLayout& layout = units_[unit];
  UnitState& state = *state_[unit];
  const DType held = options_.reduce_dtype == DType::kI8 ? DType::kF32 : options_.reduce_dtype;
  const int64_t chunk = layout.chunk_elements;
  // Padding is never written, so it stays zero: the squared norm sums whole
  // chunks. Stages 2-3 take it here, after the step's last reduction of the
  // unit, where it overlaps the backward of the units before it.
  auto norm_of_shard = [&]() -> absl::Status {
    state.grad_squares.reset();
    if (!stage_.grads_sharded || !last_micro) return absl::OkStatus();
    absl::StatusOr<double> squares = backend_->SquaredNorm(state.grads.f32(), chunk);
    if (!squares.ok()) return squares.status();
    state.grad_squares = *squares;
    return absl::OkStatus();
  };
  if (direct) return norm_of_shard();  // the collective returned with the data in place
  if (stage_.reduce_at_step) {
    state.reduced = TrackedBuffer(&memory_, MemoryCategory::kGradsTransient,
                                  Bytes(chunk, DType::kF32));
  }
  for (int i : layout.own_segments) {
    const Segment& seg = layout.segments[i];
    const void* from = At(received->data(), seg.chunk_offset, held);
    if (stage_.reduce_at_step) {
      backend_->Convert(from, held, state.reduced.f32() + seg.chunk_offset, DType::kF32,
                        seg.length);
    } else if (stale) {
      backend_->Convert(from, held, state.grads.f32() + seg.chunk_offset, DType::kF32,
                        seg.length);
    } else {
      backend_->AddInto(from, held, state.grads.f32() + seg.chunk_offset, seg.length);
    }
  }
  if (absl::Status s = norm_of_shard(); !s.ok()) return s;
  return backend_->Synchronize();
}

// ---- The pass ----

absl::StatusOr<double> ZeroEngine::ForwardBackward(bool last_micro) {
  const int n = static_cast<int>(ops_.size());
  auto views = [this](int unit, float* flat) {
    const UnitLayout& layout = units_[unit];
    UnitTensors out(layout.tensors.size());
    for (size_t t = 0; t < layout.tensors.size(); ++t) {
      out[t].data = flat + layout.tensor_offsets[t];
      out[t].shape = layout.tensors[t].shape;
    }
    return out;
  };
  for (int k = 0; k < n; ++k) {
    absl::StatusOr<float*> params = AcquireParams(k, 2 * n - 1);
    if (!params.ok()) return params.status();
    absl::Time start = absl::Now();
    absl::Status s = model_->Forward(k, views(ops_[k], *params));
    times_.forward_ms += MsSince(start);
    if (!s.ok()) return s;
    memory_.Set(MemoryCategory::kActivations, model_->ActivationBytes());
    ReleaseParams(k);
  }
  for (int j = 0; j < n; ++j) {
    const int op = n - 1 - j, pos = n + j, unit = ops_[op];
    UnitState& state = *state_[unit];
    absl::StatusOr<float*> params = AcquireParams(pos, 2 * n - 1);
    if (!params.ok()) return params.status();
    float* grads = state.grads.f32();
    // The first backward op of a unit in a micro-batch writes its gradient
    // (no clearing pass) into a fresh buffer (stages 2-3) or, on the first
    // micro-batch, into the step's flat gradient (stages 0-1); later ones add.
    Model::GradMode mode = Model::GradMode::kAdd;
    if (stage_.grads_sharded) {
      if (pos == first_backward_[unit]) {
        state.grads_flat = TrackedBuffer(&memory_, MemoryCategory::kGradsTransient,
                                         Bytes(units_[unit].flat_elements, DType::kF32),
                                         /*zero=*/false);
        mode = Model::GradMode::kOverwrite;
      }
      grads = state.grads_flat.f32();
    } else if (state.grads_stale && pos == first_backward_[unit]) {
      mode = Model::GradMode::kOverwrite;
    }
    if (!stage_.grads_sharded) state.grads_stale = false;
    UnitTensors grad_views = views(unit, grads);
    absl::Time start = absl::Now();
    absl::Status s = model_->BackwardInto(op, views(unit, *params), grad_views, mode);
    times_.backward_ms += MsSince(start);
    if (!s.ok()) return s;
    ReleaseParams(pos);
    if (pos == last_backward_[unit] && (stage_.grads_sharded || last_micro)) {
      // The task owns the flat gradient: the next micro-batch's backward of
      // this unit may start before the reduction has packed it.
      std::shared_ptr<Fence> computed = backend_->Record();
      // However the task ends (even skipped after an earlier failure), the
      // flat gradient is freed only after the backward that writes it.
      std::shared_ptr<TrackedBuffer> flat(new TrackedBuffer(std::move(state.grads_flat)),
                                          [computed](TrackedBuffer* buffer) {
                                            if (computed != nullptr) computed->Wait().IgnoreError();
                                            delete buffer;
                                          });
      reduce_thread_->Submit(
          [this, unit, flat, computed, last_micro] {
            return ReduceUnit(unit, flat.get(), computed.get(), last_micro);
          });
    }
  }
  memory_.Set(MemoryCategory::kActivations, model_->ActivationBytes());
  slots_.clear();
  // Read after the backward pass (which does not change it): on a device,
  // reading the loss waits for the GPU, which mid-pass would stall it.
  const double loss = model_->Loss();
  loss_sum_ += loss;
  micro_batches_++;
  return loss;
}

absl::StatusOr<double> ZeroEngine::Forward() {
  const int n = static_cast<int>(ops_.size());
  // Evaluation between steps does not count toward the next step's times.
  const StepTimes saved_times = times_;
  absl::Cleanup restore_times = [this, saved_times] { times_ = saved_times; };
  for (int k = 0; k < n; ++k) {
    absl::StatusOr<float*> params = AcquireParams(k, n - 1);
    if (!params.ok()) return params.status();
    const UnitLayout& layout = units_[ops_[k]];
    UnitTensors views(layout.tensors.size());
    for (size_t t = 0; t < layout.tensors.size(); ++t) {
      views[t].data = *params + layout.tensor_offsets[t];
      views[t].shape = layout.tensors[t].shape;
    }
    if (absl::Status s = model_->Forward(k, views); !s.ok()) return s;
    memory_.Set(MemoryCategory::kActivations, model_->ActivationBytes());
    // The last forward position would hand its unit to the (absent) backward.
    ReleaseParams(k, /*backward_follows=*/false);
  }
  slots_.clear();
  return model_->Loss();
}

absl::Status ZeroEngine::AllGatherReplicated(int unit, const float* master_shard) {
  const UnitLayout& layout = units_[unit];
  UnitState& state = *state_[unit];
  const DType dtype = options_.param_dtype;
  const int64_t chunk = layout.chunk_elements;
  // Straight into the replicated parameters (bf16: from a narrowed shard).
  const void* input = master_shard;
  TrackedBuffer send;
  if (dtype != DType::kF32) {
    send = TrackedBuffer(&memory_, MemoryCategory::kCommBuffers, Bytes(chunk, dtype),
                         /*zero=*/false);
    backend_->Convert(master_shard, DType::kF32, send.data(), dtype, chunk);
    input = send.data();
  }
  if (absl::Status s = backend_->Synchronize(); !s.ok()) return s;  // the optimizer's update
  EnterCollective(kGatherStream, "all_gather", layout.name);
  absl::Status s = gather_comm_->AllGatherBlocks(input, state.replicated.data(), layout.blocks,
                                                 dtype, options_.collective_timeout);
  LeaveCollective(kGatherStream);
  if (!s.ok()) {
    return absl::Status(s.code(), absl::StrCat("all_gather of ", Where(unit), ": ", s.message()));
  }
  return absl::OkStatus();
}

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
  // Average over micro-batches; the squared norm of that gradient here.
  const float scale = 1.0f / static_cast<float>(options_.grad_accum);
  double squares = 0;
  for (size_t u = 0; u < units_.size(); ++u) {
    auto [g, n] = StepGradient(u);
    if (g == nullptr) return absl::InternalError(absl::StrCat("no gradient for ", Where(u)));
    if (scale != 1.0f) backend_->Scale(g, n, scale);
    std::optional<double>& known = state_[u]->grad_squares;
    if (known.has_value()) {
      // Taken before the 1/grad_accum scaling (exact for powers of two,
      // within rounding otherwise).
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
  local.grad_squares = grad_squares;
  if (shard_checksum_.has_value()) {
    local.shard_checksum = *shard_checksum_;
    local.has_checksum = 1;
    shard_checksum_.reset();
  }
  std::vector<RankNumerics> all(world_);
  static_assert(sizeof(RankNumerics) == 8 * sizeof(float), "four 8-byte fields");
  absl::Status s =
      aux_comm_->AllGather(&local, all.data(), 8, DType::kF32, options_.collective_timeout);
  if (!s.ok()) {
    return absl::Status(s.code(), absl::StrCat("all_gather of the step's loss and gradient norm "
                                               "(rank ",
                                               rank_, " of ", world_, "): ", s.message()));
  }
  return JudgeStep(all, stage_.state_sharded, group_size_, rank_);
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
    const int prefetch_limit = std::min(options_.prefetch, static_cast<int>(ops_.size()) - 1);
    for (int k = 0; k <= prefetch_limit; ++k) {
      if (positions_[k] != u) continue;
      if (absl::Status s = backend_->Synchronize(); !s.ok()) return s;
      if (absl::Status s = IssueGather(k); !s.ok()) return s;
    }
  } else if (!stage_.state_sharded) {
    float* p = bf16_params ? st.master.f32() : st.replicated.f32();
    if (absl::Status s = st.optimizer->Step(p, g, n, lr); !s.ok()) return s;
    if (bf16_params) {
      backend_->Convert(p, DType::kF32, st.replicated.data(), options_.param_dtype, n);
    }
  } else {
    TrackedBuffer packed;
    float* p = st.master.f32();
    if (!bf16_params) {  // fp32: the replicated parameters are their own master
      packed = TrackedBuffer(&memory_, MemoryCategory::kCommBuffers, Bytes(n, DType::kF32),
                             /*zero=*/false);
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
  if (replica_thread_ != nullptr) {
    if (absl::Status s = replica_thread_->Drain(); !s.ok()) return s;
  }
  if (absl::Status s = gather_thread_->Drain(); !s.ok()) return s;
  times_.reduce_wait_ms += MsSince(wait_start);
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

TrackedBuffer& ZeroEngine::MasterShard(int unit) { return state_[unit]->master; }

void ZeroEngine::MarkSecondaryStale(int unit) { state_[unit]->secondary_fresh = false; }

int ZeroEngine::replica_peer() const {
  const int replicas = world_ / group_size_;
  if (replicas < 2) return -1;
  return ((rank_ / group_size_ + 1) % replicas) * group_size_ + rank_ % group_size_;
}

absl::Status ZeroEngine::ForEachOwnPiece(const std::function<absl::Status(const PieceView&)>& visit,
                                         bool with_replica_peer) {
  const bool bf16_params = options_.param_dtype == DType::kBF16;
  if (absl::Status s = backend_->Synchronize(); !s.ok()) return s;
  std::vector<std::vector<float>> host;  // staging, device backends only
  for (size_t u = 0; u < units_.size(); ++u) {
    const UnitLayout& layout = units_[u];
    UnitState& st = *state_[u];
    std::vector<const Segment*> pieces;
    for (const Segment& seg : layout.saved) pieces.push_back(&seg);
    if (with_replica_peer) {
      for (const Segment& seg : layout.replica_peer_saved) pieces.push_back(&seg);
    }
    for (const Segment* piece : pieces) {
      const Segment& seg = *piece;
      PieceView view;
      view.tensor = &layout.tensors[seg.tensor];
      view.row_begin = seg.row_begin;
      view.row_end = seg.row_end;
      view.elements = seg.length;
      // Where the piece's master values and moments live.
      int64_t state_offset = !stage_.state_sharded ? seg.flat_offset : seg.chunk_offset;
      if (stage_.params_sharded || bf16_params) {
        view.params = st.master.f32() + state_offset;
      } else {
        view.params = st.replicated.f32() + seg.flat_offset;
      }
      float* m = st.optimizer->exp_avg();
      float* v = st.optimizer->exp_avg_sq();
      view.exp_avg = m ? m + state_offset : nullptr;
      view.exp_avg_sq = v ? v + state_offset : nullptr;
      if (!backend_->host_accessible()) {
        // Device memory: the visitor sees host copies.
        const int64_t bytes = seg.length * static_cast<int64_t>(sizeof(float));
        for (float** p : {&view.params, &view.exp_avg, &view.exp_avg_sq}) {
          if (*p == nullptr) continue;
          host.emplace_back(seg.length);
          if (absl::Status s = backend_->CopyToHost(host.back().data(), *p, bytes); !s.ok()) {
            return s;
          }
          *p = host.back().data();
        }
      }
      absl::Status s = visit(view);
      host.clear();
      if (!s.ok()) return s;
    }
  }
  return absl::OkStatus();
}

int64_t ZeroEngine::optimizer_step() const {
  return state_.empty() ? 0 : state_[0]->optimizer->step();
}

void ZeroEngine::set_optimizer_step(int64_t step) {
  for (auto& s : state_) s->optimizer->set_step(step);
}

}  // namespace zeroshard
