// ZeroEngine's Create-time planning (engine.h): the options checked against
// the plan, every unit's layout (segments, blocks, hpZ slices) and its
// buffers by stage.
#include <algorithm>
#include <cassert>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "worker/zero/engine.h"
#include "worker/zero/engine_internal.h"

namespace zeroshard {

using engine_internal::Bytes;

namespace engine_internal {

// The dtypes of the parameters, reductions and gathers, and where int8 may run.
static absl::Status ValidateDTypes(const EngineOptions& options) {
  if (options.param_dtype != DType::kF32 && options.param_dtype != DType::kBF16) {
    return absl::InvalidArgumentError(absl::StrCat("param dtype ", DTypeName(options.param_dtype),
                                                   " is not supported: expected f32 or bf16"));
  }
  if (options.reduce_dtype != DType::kF32 && options.reduce_dtype != DType::kBF16 &&
      options.reduce_dtype != DType::kI8) {
    return absl::InvalidArgumentError(
        absl::StrCat("reduce dtype ", DTypeName(options.reduce_dtype),
                     " is not supported: expected f32, bf16 or int8"));
  }
  if (options.gather_dtype != DType::kF32 && options.gather_dtype != DType::kI8) {
    return absl::InvalidArgumentError(absl::StrCat("gather dtype ", DTypeName(options.gather_dtype),
                                                   " is not supported: expected f32 or int8"));
  }
  if (options.gather_dtype == DType::kI8 &&
      (options.stage != 3 || options.param_dtype != DType::kF32)) {
    return absl::InvalidArgumentError(
        absl::StrCat("int8 gathers quantize stage 3's f32 parameter gathers; this run has stage ",
                     options.stage, " and param dtype ", DTypeName(options.param_dtype),
                     ": use --stage=3 --param_dtype=f32, or --gather_dtype=f32"));
  }
  const bool int8 = options.gather_dtype == DType::kI8 || options.reduce_dtype == DType::kI8;
  if (int8 && options.backend != nullptr && !options.backend->host_accessible()) {
    return absl::InvalidArgumentError(
        absl::StrCat("int8 gathers and reductions run on host memory; backend '",
                     options.backend->name(), "' is not: use f32 or bf16 there"));
  }
  return absl::OkStatus();
}

absl::Status ValidateOptions(const EngineOptions& options, const ShardPlan& plan,
                             const Communicator* gather, const Communicator* reduce,
                             const Communicator* aux) {
  if (options.stage < 0 || options.stage > 3) {
    return absl::InvalidArgumentError(
        absl::StrCat("stage ", options.stage, " is not a ZeRO stage: expected 0, 1, 2 or 3"));
  }
  if (options.prefetch < 0) {
    return absl::InvalidArgumentError(absl::StrCat("prefetch ", options.prefetch, " must be >= 0"));
  }
  if (options.grad_accum < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("grad_accum ", options.grad_accum, " must be >= 1"));
  }
  if (options.global_micro_batches < 0 ||
      options.global_micro_batches > int64_t{options.grad_accum} * aux->world_size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "global_micro_batches ", options.global_micro_batches, " must be in [0, grad_accum ",
        options.grad_accum, " x ", aux->world_size(), " ranks]: the micro-batches of a step"));
  }
  if (absl::Status s = ValidateDTypes(options); !s.ok()) return s;
  const int group = plan.options.Groups(plan.world_size).size();
  if (gather->world_size() != group || reduce->world_size() != group ||
      aux->world_size() != plan.world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("the plan is for world size ", plan.world_size, " in shard groups of ", group,
                     " but the communicators have ", gather->world_size(), " (gather), ",
                     reduce->world_size(), " (reduce) and ", aux->world_size(), " (aux)"));
  }
  if (options.numerics != nullptr && options.numerics->world_size() != group &&
      options.numerics->world_size() != plan.world_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the step numerics' communicator has ", options.numerics->world_size(),
        " ranks: expected the shard group's ", group, " or the world's ", plan.world_size));
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
  if (absl::Status s = ValidateOuterOptions(options, replicas); !s.ok()) return s;
  if (replicas > 1) {
    if (options.replicas == nullptr || options.replicas->world_size() != replicas) {
      return absl::InvalidArgumentError(
          absl::StrCat("the plan has ", replicas, " replicas of each shard (groups of ", group,
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

}  // namespace engine_internal

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

// A plan's piece as the layouts read it: whole rows of one of its unit's
// tensors, held by a rank of the job, inside the chunk. The step path's
// copies and collectives trust these bounds.
absl::Status CheckPiece(const ShardUnit& unit, const Piece& p, int world) {
  const int tensors = static_cast<int>(unit.tensors.size());
  if (p.tensor < 0 || p.tensor >= tensors || p.rank < 0 || p.rank >= world) {
    return absl::InvalidArgumentError(
        absl::StrCat("plan unit '", unit.name, "' has a piece of tensor ", p.tensor, " on rank ",
                     p.rank, "; the unit has ", tensors, " tensors and the job ", world,
                     " ranks: the plan is not for this job, plan again"));
  }
  const TensorSpec& t = unit.tensors[p.tensor];
  const int64_t length = (p.row_end - p.row_begin) * t.RowElements();
  if (p.row_begin < 0 || p.row_end > t.Rows() || p.row_begin >= p.row_end || p.offset < 0 ||
      p.offset + length > unit.chunk_elements) {
    return absl::InvalidArgumentError(absl::StrCat(
        "plan unit '", unit.name, "': the piece of '", t.name, "' rows [", p.row_begin, ", ",
        p.row_end, ") of ", t.Rows(), " at chunk offset ", p.offset, " does not fit a chunk of ",
        unit.chunk_elements, " elements: the plan is damaged or of another version, plan again"));
  }
  return absl::OkStatus();
}

// The pieces of all members cover the unit's flat layout once: gathers
// write every element of a gathered unit, which is not cleared first.
absl::Status CheckCover(const UnitLayout& layout) {
  std::vector<std::pair<int64_t, int64_t>> ranges;  // flat [begin, end)
  for (const Segment& s : layout.segments)
    ranges.push_back({s.flat_offset, s.flat_offset + s.length});
  std::sort(ranges.begin(), ranges.end());
  int64_t covered = 0;
  for (const auto& [begin, end] : ranges) {
    if (begin != covered) break;
    covered = end;
  }
  if (covered != layout.flat_elements) {
    return absl::InvalidArgumentError(
        absl::StrCat("plan unit '", layout.name, "': its pieces cover ", covered, " of its ",
                     layout.flat_elements,
                     " elements before a gap or an overlap: the plan is damaged, plan again"));
  }
  return absl::OkStatus();
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
      return absl::InvalidArgumentError(
          absl::StrCat("plan unit ", u, " is '", pu.name, "' with ", pu.tensors.size(),
                       " tensors; the model's is '", unit_names[u], "' with ", tensors.size()));
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
      if (absl::Status s = CheckPiece(pu, p, world_); !s.ok()) return s;
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
    if (absl::Status s = CheckCover(layout); !s.ok()) return s;
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
      assert(count <= 0 || begin + count <= u.flat_elements);
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
    assert(s.chunk_offset + s.length <= u.chunk_elements && "a piece lies inside its chunk");
    backend_->Copy(chunk + s.chunk_offset, flat + s.flat_offset, s.length * sizeof(float));
  }
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
      state->replicated =
          TrackedBuffer(m, MemoryCategory::kParamsReplicated, Bytes(flat, options_.param_dtype));
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

int64_t ZeroEngine::SecondaryGatherElements(int unit) const {
  const UnitLayout& u = units_[unit];
  if (!packed_ || secondary_comm_ == nullptr) return u.flat_elements;
  return std::max(u.flat_elements, secondary_comm_->world_size() * u.secondary_elements);
}

// The step path's buffers (step_buffers.h), by stage and options: each pool
// holds what its users can hold at once, so that no step allocates, and only
// a thread whose buffers another thread gives back (the flat gradients, the
// replicas' chunks) ever waits for one.
void ZeroEngine::PlanStepBuffers() {
  MemoryTracker* m = &memory_;
  const int64_t flat = largest_unit_elements();
  int64_t gathered = flat;  // hpZ's packed gathers write every slice whole
  for (size_t u = 0; u < units_.size(); ++u) {
    gathered = std::max(gathered, SecondaryGatherElements(static_cast<int>(u)));
  }
  int64_t chunk = 0;
  for (const UnitLayout& u : units_) chunk = std::max(chunk, u.chunk_elements);
  const DType param = options_.param_dtype;
  if (stage_.params_sharded) {
    // Into this rank's own buffers unless shared regions take the gathers
    // (hpZ's backward gathers from the secondary slices still do).
    if (shared_gather_ == nullptr || secondary_comm_ != nullptr) {
      for (int i = 0; i < window_.PeakUnits(); ++i) {
        buffers_.gathered.Reserve(m, Bytes(gathered, DType::kF32));
      }
    }
    if (packed_ && options_.gather_dtype != DType::kI8) {
      // A group of one unpacks f32 straight from the shard (GatherUnitAlone).
      if (gather_comm_->world_size() > 1 || param != DType::kF32) {
        buffers_.gather_wire.Reserve(m, Bytes(gather_comm_->world_size() * chunk, param));
      }
    } else if (param != DType::kF32) {
      buffers_.gather_wire.Reserve(m, Bytes(chunk, param));
      buffers_.gather_wire.Reserve(m, Bytes(flat, param));
    }
  } else if (param != DType::kF32) {
    buffers_.gathered.Reserve(m, Bytes(flat, DType::kF32));  // one position at a time
  }
  if (stage_.state_sharded && !stage_.params_sharded) {
    // Packed: the G chunks of UpdateReplicatedPacked; else the f32 shard the
    // optimizer steps on, or the narrowed one AllGatherReplicated sends.
    buffers_.sync.Reserve(
        m, packed_ ? Bytes(gather_comm_->world_size() * chunk, param) : Bytes(chunk, DType::kF32));
  }
  // Units whose backward writes the gradient shard itself take none.
  const bool any_flat_gradient =
      std::any_of(backward_into_shard_.begin(), backward_into_shard_.end(),
                  [](const std::vector<int64_t>& offsets) { return offsets.empty(); });
  if (stage_.grads_sharded && any_flat_gradient) {
    for (int i = 0; i < MostUnitsOpenInBackward() + StepBuffers::kFlatGradientsAhead; ++i) {
      buffers_.flat_grads.Reserve(m, Bytes(flat, DType::kF32));
    }
  }
  if (stage_.reduce_at_step) {
    for (const UnitLayout& u : units_)
      buffers_.reduced.Reserve(m, Bytes(u.chunk_elements, DType::kF32));
  }
  // The reduce thread's one narrowed or packed gradient at a time (packed:
  // the reduce-scatter's dtype, f32 for int8 inside the group).
  const DType reduced_dtype =
      options_.reduce_dtype == DType::kI8 && options_.int8_group_reduce_in_f32
          ? DType::kF32
          : options_.reduce_dtype;
  if (packed_ && reduced_dtype != DType::kI8) {
    // A group of one packs straight into the reduced chunk (ReduceUnit).
    const int g = reduce_comm_->world_size();
    if (g > 1) buffers_.reduce_wire.Reserve(m, Bytes(g * chunk, reduced_dtype));
  } else if (options_.reduce_dtype == DType::kBF16) {
    buffers_.reduce_wire.Reserve(m, Bytes(flat, DType::kBF16));
  }
  // Received chunks: every reduction of stage 1, and those of stages 2-3
  // past a step's first (f32), unless the backward writes the shard itself.
  if (stage_.state_sharded && (!stage_.grads_sharded || any_flat_gradient)) {
    const bool replica_thread = per_step_replicas() && options_.replica_thread;
    for (int i = 0; i < (replica_thread ? StepBuffers::kReplicaChunks : 1); ++i) {
      buffers_.received.Reserve(m, Bytes(chunk, DType::kF32));  // f32 or narrower
    }
  }
  all_numerics_.resize(numerics_comm_->world_size());
  if (stage_.state_sharded && !backend_->host_accessible()) {
    hash_staging_.resize(static_cast<size_t>(Bytes(chunk, DType::kF32)));
  }
}

// The most units whose flat gradients the backward holds at once: a unit's
// from its first backward position to its last (several with shared
// weights, e.g. a tied head).
int ZeroEngine::MostUnitsOpenInBackward() const {
  const int n = static_cast<int>(ops_.size());
  int most = 0;
  for (int pos = n; pos < 2 * n; ++pos) {
    int open = 0;
    for (size_t u = 0; u < units_.size(); ++u) {
      open += first_backward_[u] >= 0 && first_backward_[u] <= pos && pos <= last_backward_[u];
    }
    most = std::max(most, open);
  }
  return most;
}

}  // namespace zeroshard
