// ZeroEngine's gathers (engine.h): stage 3's window of gathered units
// (IssueGather, AcquireParams, and ReleaseParams, where a gathered unit is
// freed or handed on), the gathers themselves (plain, into shared regions,
// int8, from hpZ's secondary slices) and stages 1-2's parameter sync.
#include <algorithm>
#include <cassert>
#include <memory>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "worker/comm/quantized.h"
#include "worker/zero/engine.h"
#include "worker/zero/engine_internal.h"

namespace zeroshard {

using engine_internal::Bytes;
using engine_internal::MsSince;

// Stage 3, f32 on the host: every rank writes its pieces once into a region
// all ranks read in place. Regions: the 1 + prefetch units of the window and
// one more, since a region is reused only once every gather before it has
// been released (units kept for the backward are released out of gather
// order).
absl::Status ZeroEngine::SetUpSharedGather() {
  if (!stage_.params_sharded || !options_.shared_gather || options_.param_dtype == DType::kBF16 ||
      options_.gather_dtype == DType::kI8 || !backend_->host_accessible()) {
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

absl::Status ZeroEngine::SetUpPackedCollectives() {
  packed_ =
      stage_.state_sharded && options_.packed_collectives.value_or(!backend_->host_accessible());
  if (!packed_) return absl::OkStatus();
  const int g = gather_comm_->world_size();
  for (UnitLayout& layout : units_) {
    absl::StatusOr<PackedLayout> packed = MakePackedLayout(layout.blocks, g, layout.chunk_elements);
    if (!packed.ok()) {
      return absl::Status(packed.status().code(),
                          absl::StrCat("unit ", layout.name, ": ", packed.status().message()));
    }
    layout.packed = std::move(*packed);
    if (absl::Status s = backend_->PreparePacked(&layout.packed); !s.ok()) return s;
  }
  return absl::OkStatus();
}

void ZeroEngine::SetUpBackwardIntoShard() {
  backward_into_shard_.assign(units_.size(), {});
  if (!stage_.grads_sharded || stage_.reduce_at_step || !packed_ ||
      reduce_comm_->world_size() != 1 || replica_comm_ != nullptr ||
      options_.reduce_dtype != DType::kF32) {
    return;
  }
  for (size_t u = 0; u < units_.size(); ++u) {
    const UnitLayout& layout = units_[u];
    std::vector<int64_t> offsets;
    for (size_t t = 0; t < layout.tensors.size(); ++t) {
      const int64_t begin = layout.tensor_offsets[t];
      const int64_t end = begin + layout.tensors[t].Elements();
      auto piece =
          std::find_if(layout.segments.begin(), layout.segments.end(), [&](const Segment& seg) {
            return seg.flat_offset <= begin && end <= seg.flat_offset + seg.length;
          });
      if (piece == layout.segments.end()) break;  // split over pieces: the flat path
      offsets.push_back(piece->chunk_offset + (begin - piece->flat_offset));
    }
    if (offsets.size() == layout.tensors.size()) backward_into_shard_[u] = std::move(offsets);
  }
}

// ---- Stage 3 gathers ----

// Packed over a group of one: the shard is the whole packed layout, so the
// unit is unpacked straight from it (f32), rounded through bf16 as it is
// unpacked (bf16, where the backend has that pass: one kernel), or from its
// narrowed copy (bf16 elsewhere); no collective runs.
absl::Status ZeroEngine::GatherUnitAlone(int unit, TrackedBuffer* out, bool keep_secondary) {
  const UnitLayout& layout = units_[unit];
  const DType dtype = options_.param_dtype;
  const float* master = state_[unit]->master.f32();
  TrackedBuffer narrowed;  // held until the kernels reading it are done
  if (dtype == DType::kF32) {
    backend_->Unpack(layout.packed, master, dtype, out->f32());
  } else if (!backend_->UnpackThrough(layout.packed, master, dtype, out->f32())) {
    absl::StatusOr<TrackedBuffer> wire = buffers_.gather_wire.Lend(
        MemoryCategory::kCommBuffers, Bytes(layout.chunk_elements, dtype), /*zero=*/false);
    if (!wire.ok()) return wire.status();
    narrowed = std::move(*wire);
    backend_->Convert(master, DType::kF32, narrowed.data(), dtype, layout.chunk_elements);
    backend_->Unpack(layout.packed, narrowed.data(), dtype, out->f32());
  }
  if (keep_secondary) KeepSecondarySlice(unit, out->f32());
  return backend_->Synchronize();  // the compute thread reads it next
}

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
  if (packed_ && gather_comm_->world_size() == 1) return GatherUnitAlone(unit, out, keep_secondary);
  if (packed_) {
    // The shard goes in at this rank's chunk of the packed buffer (bf16:
    // narrowed there, so the gather runs in place), one AllGather fills the
    // other chunks, and one Unpack widens them into the flat layout.
    const int64_t g = gather_comm_->world_size();
    absl::StatusOr<TrackedBuffer> wire = buffers_.gather_wire.Lend(
        MemoryCategory::kCommBuffers, Bytes(g * chunk, dtype), /*zero=*/false);
    if (!wire.ok()) return wire.status();
    TrackedBuffer packed = std::move(*wire);
    const void* input = state.master.data();
    if (dtype != DType::kF32) {
      void* own = engine_internal::At(packed.data(), gather_comm_->rank() * chunk, dtype);
      backend_->Convert(state.master.data(), DType::kF32, own, dtype, chunk);
      input = own;
    }
    if (absl::Status s = backend_->Synchronize(); !s.ok()) return s;
    EnterCollective(kGatherStream, "all_gather", layout.name);
    absl::Status s =
        gather_comm_->AllGather(input, packed.data(), chunk, dtype, options_.collective_timeout);
    LeaveCollective(kGatherStream);
    if (!s.ok()) {
      return absl::Status(s.code(), absl::StrCat("all_gather of ", Where(unit), ": ", s.message()));
    }
    backend_->Unpack(layout.packed, packed.data(), dtype, out->f32());
    if (keep_secondary) KeepSecondarySlice(unit, out->f32());
    return backend_->Synchronize();  // the compute thread reads it next
  }
  // f32: the pieces land straight in the unit's flat buffer. bf16: they
  // travel as bf16 and are widened once.
  TrackedBuffer send, received;
  const void* input = state.master.data();
  void* output = out->data();
  if (dtype != DType::kF32) {
    // One gather at a time (the gather thread, or HoldGatheredParameters
    // after draining it): the pool's two buffers, never waited for.
    absl::StatusOr<TrackedBuffer> narrowed = buffers_.gather_wire.Lend(
        MemoryCategory::kCommBuffers, Bytes(chunk, dtype), /*zero=*/false);
    if (!narrowed.ok()) return narrowed.status();
    send = std::move(*narrowed);
    backend_->Convert(state.master.data(), DType::kF32, send.data(), dtype, chunk);
    input = send.data();
    absl::StatusOr<TrackedBuffer> wire = buffers_.gather_wire.Lend(
        MemoryCategory::kCommBuffers, Bytes(layout.flat_elements, dtype), /*zero=*/false);
    if (!wire.ok()) return wire.status();
    received = std::move(*wire);
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
    assert(b.shard_offset + b.count <= layout.secondary_elements && "a slice fits its buffer");
    backend_->Copy(state_[unit]->secondary.f32() + b.shard_offset, flat + b.full_offset,
                   b.count * sizeof(float));
  }
}

// Member m's secondary slice is the unit's flat elements [m * se, + its
// count) (se: secondary_elements), so with packed collectives one plain
// AllGather of se elements lands every slice in place: the last member's
// tail goes past the unit's elements, into room SecondaryGatherElements
// asks of the buffer. The block all-gather otherwise.
absl::Status ZeroEngine::GatherUnitFromSecondary(int unit, TrackedBuffer* out) {
  const UnitLayout& layout = units_[unit];
  const void* slice = state_[unit]->secondary.data();
  EnterCollective(kGatherStream, "all_gather", layout.name);
  absl::Status s;
  if (packed_) {
    assert(out->bytes() >=
               Bytes(secondary_comm_->world_size() * layout.secondary_elements, DType::kF32) &&
           "the buffer holds every member's whole slice");
    s = secondary_comm_->AllGather(slice, out->data(), layout.secondary_elements, DType::kF32,
                                   options_.collective_timeout);
  } else {
    s = secondary_comm_->AllGatherBlocks(slice, out->data(), layout.secondary_blocks, DType::kF32,
                                         options_.collective_timeout);
  }
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
  const int unit = window_.unit(position);
  GatherSlot& slot = slots[position];
  if (window_.TakesOver(position)) {
    slot.ticket = 0;  // the previous position keeps its buffer for us
    return absl::OkStatus();
  }
  // hpZ: the backward reads the secondary slices when they hold the unit's
  // current parameters; every other gather refreshes them (the gather
  // thread runs tasks in issue order, so later tasks see the slice).
  UnitState& state = *state_[unit];
  const bool from_secondary = secondary_comm_ != nullptr &&
                              position >= static_cast<int>(ops_.size()) && state.secondary_fresh;
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
  // Never waits: the pool holds the window's peak (GatherWindow::PeakUnits).
  absl::StatusOr<TrackedBuffer> params = buffers_.gathered.Lend(
      MemoryCategory::kParamsGathered,
      Bytes(from_secondary ? SecondaryGatherElements(unit) : units_[unit].flat_elements,
            DType::kF32),
      /*zero=*/false);
  if (!params.ok()) return params.status();
  slot.params = std::move(*params);
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
  const int unit = window_.unit(position);
  if (!held_.empty()) return held_[unit].f32();
  if (!stage_.params_sharded) {
    UnitState& state = *state_[unit];
    if (options_.param_dtype == DType::kF32) return state.replicated.f32();
    // bf16 parameters: the model computes on an f32 copy (every element
    // converted).
    const int64_t flat = units_[unit].flat_elements;
    absl::StatusOr<TrackedBuffer> copy = buffers_.gathered.Lend(
        MemoryCategory::kParamsGathered, Bytes(flat, DType::kF32), /*zero=*/false);
    if (!copy.ok()) return copy.status();
    GatherSlot& slot = slots_[position];
    slot.params = std::move(*copy);
    backend_->Convert(state.replicated.data(), options_.param_dtype, slot.params.data(),
                      DType::kF32, flat);
    return slot.params.f32();
  }
  for (int p = position; p <= window_.IssueEnd(position, last_position); ++p) {
    if (absl::Status s = IssueGather(p); !s.ok()) return s;
  }
  GatherSlot& slot = slots_[position];
  if (slot.ticket != 0) {
    absl::Time start = absl::Now();
    absl::Status s = gather_thread_->Wait(slot.ticket);
    times_.gather_wait_ms += MsSince(start);
    if (!s.ok()) return s;
  }
  // The model reads parameters only: a shared region is never written here.
  if (slot.shared != nullptr) return const_cast<float*>(slot.shared->data);
  assert(!slot.params.empty() && "an acquired position holds its unit");
  return slot.params.f32();
}

// Where a gathered unit is freed: its slot's buffer goes back to the
// gathered-units pool (or its shared region is released), unless the
// window hands it to a later position of the same unit.
void ZeroEngine::ReleaseParams(int position, bool backward_follows) {
  auto& slots = slots_;
  auto it = slots.find(position);
  if (it == slots.end()) return;
  if (stage_.params_sharded) {
    // A mirror position is gathered only after this release, so its slot
    // does not exist yet; never replace a slot with a gather in flight.
    const int next = window_.HandOverTarget(position, backward_follows);
    if (GatherWindow::HandsOver(position, next, slots.count(next) > 0)) {
      assert(slots[next].ticket == 0 && slots[next].params.empty() &&
             slots[next].shared == nullptr && "a hand-over replaces no unit");
      slots[next].params = std::move(it->second.params);
      slots[next].shared = std::move(it->second.shared);
      slots[next].ticket = 0;
    }
  }
  slots.erase(position);
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
    absl::StatusOr<TrackedBuffer> narrowed =
        buffers_.sync.Lend(MemoryCategory::kCommBuffers, Bytes(chunk, dtype), /*zero=*/false);
    if (!narrowed.ok()) return narrowed.status();
    send = std::move(*narrowed);
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

// Stages 1-2, packed: the update lands in this rank's chunk of a buffer of G
// packed chunks (f32: the optimizer steps there, on the replicated
// parameters' own pieces packed into it; bf16: the f32 master shard
// narrowed into it), one AllGather in place fills the other chunks, and one
// UnpackRaw copies every piece into the replicated parameters: one kernel
// after the collective where AllGatherReplicated's block all-gather copies
// piece by piece.
absl::Status ZeroEngine::UpdateReplicatedPacked(int unit, const float* grads, int64_t n, double lr,
                                                double* param_sync_ms) {
  const UnitLayout& layout = units_[unit];
  UnitState& state = *state_[unit];
  const DType dtype = options_.param_dtype;
  const int64_t chunk = layout.chunk_elements;
  const int64_t g = gather_comm_->world_size();
  absl::StatusOr<TrackedBuffer> wire =
      buffers_.sync.Lend(MemoryCategory::kCommBuffers, Bytes(g * chunk, dtype), /*zero=*/false);
  if (!wire.ok()) return wire.status();
  void* own = engine_internal::At(wire->data(), gather_comm_->rank() * chunk, dtype);
  if (dtype == DType::kF32) {
    float* shard = static_cast<float*>(own);
    PackOwn(layout, state.replicated.f32(), shard);
    if (absl::Status s = state.optimizer->Step(shard, grads, n, lr); !s.ok()) return s;
  } else {
    if (absl::Status s = state.optimizer->Step(state.master.f32(), grads, n, lr); !s.ok()) return s;
    backend_->Convert(state.master.f32(), DType::kF32, own, dtype, chunk);
  }
  const absl::Time sync_start = absl::Now();
  if (g > 1) {  // (alone, UnpackRaw follows the update in this thread's order of work)
    if (absl::Status s = backend_->Synchronize(); !s.ok()) return s;  // the update, the narrowing
    EnterCollective(kGatherStream, "all_gather", layout.name);
    absl::Status s =
        gather_comm_->AllGather(own, wire->data(), chunk, dtype, options_.collective_timeout);
    LeaveCollective(kGatherStream);
    if (!s.ok()) {
      return absl::Status(s.code(), absl::StrCat("all_gather of ", Where(unit), ": ", s.message()));
    }
  }
  // The buffer goes back to the pool below; the next unit's writes to it
  // follow this copy in the thread's order of work.
  backend_->UnpackRaw(layout.packed, wire->data(), dtype, state.replicated.data());
  *param_sync_ms += MsSince(sync_start);
  return absl::OkStatus();
}

}  // namespace zeroshard
