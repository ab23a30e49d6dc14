// ZeroEngine's reductions (engine.h): stage 0's all-reduce, stages 1-3's
// reduce-scatter inside the group, the replicas' average (shard groups) and
// the reduced gradient's way into the shard.
#include <cassert>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "worker/comm/quantized.h"
#include "worker/zero/engine.h"
#include "worker/zero/engine_internal.h"

namespace zeroshard {

using engine_internal::At;
using engine_internal::Bytes;

// ---- Reductions ----

// A step whose ranks carry different numbers of micro-batches
// (EngineOptions::global_micro_batches) sums: the step divides by the
// micro-batches, not by the ranks.
ReduceOp ZeroEngine::GradientReduceOp() const {
  return options_.global_micro_batches > 0 ? ReduceOp::kSum : ReduceOp::kAverage;
}

// The rounding of this unit's next int8 reduction: to nearest, or
// stochastic (EngineOptions::int8_stochastic_reduce) with a seed of its
// own, (unit, count), the same on every rank; the quantizers mix in the
// rank and destination. Reduce thread only.
Int8Rounding ZeroEngine::QuantizedReduceRounding(int unit) {
  const int64_t count = state_[unit]->quantized_reductions++;
  return Int8Rounding{options_.int8_stochastic_reduce,
                      (static_cast<uint64_t>(unit) << 40) ^ static_cast<uint64_t>(count)};
}

// Stage 0: all-reduce the unit's full gradient (average over ranks, or
// sum: GradientReduceOp), in place (bf16: through a narrowed copy).
absl::Status ZeroEngine::AllReduceUnit(int unit) {
  const UnitLayout& layout = units_[unit];
  UnitState& state = *state_[unit];
  const DType dtype = options_.reduce_dtype;
  const int64_t flat = layout.flat_elements;
  EnterCollective(kReduceStream, "all_reduce", layout.name);
  absl::Status s;
  if (dtype == DType::kF32) {
    s = reduce_comm_->AllReduce(state.grads.data(), flat, dtype, GradientReduceOp(),
                                options_.collective_timeout);
  } else if (dtype == DType::kI8) {
    s = QuantizedAllReduce(reduce_comm_, state.grads.f32(), flat, GradientReduceOp(),
                           options_.collective_timeout, QuantizedReduceRounding(unit));
  } else {
    absl::StatusOr<TrackedBuffer> buffer =
        buffers_.reduce_wire.Lend(MemoryCategory::kCommBuffers, Bytes(flat, dtype),
                                  /*zero=*/false);
    s = buffer.status();
    if (s.ok()) {
      backend_->Convert(state.grads.data(), DType::kF32, buffer->data(), dtype, flat);
      s = backend_->Synchronize();
    }
    if (s.ok()) {
      s = reduce_comm_->AllReduce(buffer->data(), flat, dtype, GradientReduceOp(),
                                  options_.collective_timeout);
    }
    if (s.ok()) backend_->Convert(buffer->data(), dtype, state.grads.data(), DType::kF32, flat);
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
                               GradientReduceOp(), options_.collective_timeout, rounding)
          : replica_comm_->AllReduce(chunk, layout.chunk_elements, dtype, GradientReduceOp(),
                                     options_.collective_timeout);
  LeaveCollective(kReplicaStream);
  if (!s.ok()) {
    return absl::Status(
        s.code(), absl::StrCat("all_reduce over the replicas of ", Where(unit), ": ", s.message()));
  }
  return absl::OkStatus();
}

absl::Status ZeroEngine::ReduceUnit(int unit, TrackedBuffer* grads_flat_buffer, Fence* computed,
                                    bool last_micro) {
  // The compute thread's backward of this unit must be done.
  if (computed != nullptr) {
    if (absl::Status s = computed->Wait(); !s.ok()) return s;
  }
  if (!stage_.state_sharded) return AllReduceUnit(unit);
  if (!backward_into_shard_[unit].empty()) {
    // A group of one: the backward wrote the shard itself; the sum over one
    // rank (or its average) is what it holds.
    return AverageAndFinish(unit, TrackedBuffer(), /*direct=*/true, last_micro, Int8Rounding{});
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
  // Stages 1-3: reduce-scatter the flat gradient straight from the flat
  // layout (bf16: from a narrowed copy; packed collectives: from the packed
  // one) into this rank's pieces.
  const float* grads_flat = stage_.reduce_at_step ? state.grads.f32() : grads_flat_buffer->f32();
  assert(grads_flat != nullptr && "a reduction has its unit's flat gradient");
  // Only this rank's pieces are written, and only they are read below. The
  // first f32 reduction of a step lands straight in the gradient shard.
  const bool direct = stage_.grads_sharded && state.grads_stale && held == DType::kF32;
  TrackedBuffer received;
  if (!direct) {
    absl::StatusOr<TrackedBuffer> chunk = LendReceived(unit, held);
    if (!chunk.ok()) return chunk.status();
    received = std::move(*chunk);
  }
  void* output = direct ? state.grads.data() : received.data();
  const bool packed = packed_ && dtype != DType::kI8;
  // Packed over a group of one: the packed gradient is the reduced chunk;
  // packed straight into it, nothing goes on the wire.
  const bool alone = packed && reduce_comm_->world_size() == 1;
  TrackedBuffer narrowed;
  if (alone) {
    backend_->Pack(layout.packed, grads_flat, output, held);
  } else {
    absl::StatusOr<TrackedBuffer> wire = GradientOnTheWire(unit, grads_flat, held, packed);
    if (!wire.ok()) return wire.status();
    narrowed = std::move(*wire);
  }
  const void* input = narrowed.empty() ? static_cast<const void*>(grads_flat) : narrowed.data();
  // The conversion, and the buffers (a device block may have come back from
  // another stream), are done before the communicator's stream touches them.
  if (absl::Status s = backend_->Synchronize(); !s.ok()) return s;
  if (!narrowed.empty() && stage_.grads_sharded) grads_flat_buffer->Reset();
  // Int8: the group's reduce-scatter and the replicas' all-reduce draw
  // from two streams of this reduction's seed.
  const Int8Rounding rounding =
      options_.reduce_dtype == DType::kI8 ? QuantizedReduceRounding(unit) : Int8Rounding{};
  const absl::Status s =
      alone ? absl::OkStatus() : ReduceScatterUnit(unit, input, output, dtype, packed, rounding);
  if (stage_.grads_sharded) grads_flat_buffer->Reset();
  narrowed.Reset();
  if (!s.ok()) return s;
  Int8Rounding replica_rounding = rounding;
  replica_rounding.seed ^= uint64_t{1} << 63;
  return AverageAndFinish(unit, std::move(received), direct, last_micro, replica_rounding);
}

// The group's reduce-scatter of one unit, `dtype` on the wire: int8 (f32 in
// and out), packed chunks, or the block layout.
absl::Status ZeroEngine::ReduceScatterUnit(int unit, const void* input, void* output, DType dtype,
                                           bool packed, Int8Rounding rounding) {
  const UnitLayout& layout = units_[unit];
  EnterCollective(kReduceStream, "reduce_scatter", layout.name);
  const absl::Status s =
      dtype == DType::kI8
          ? QuantizedReduceScatterBlocks(reduce_comm_, static_cast<const float*>(input),
                                         static_cast<float*>(output), layout.blocks,
                                         GradientReduceOp(), options_.collective_timeout, rounding)
      : packed ? reduce_comm_->ReduceScatter(input, output, layout.chunk_elements, dtype,
                                             GradientReduceOp(), options_.collective_timeout)
               : reduce_comm_->ReduceScatterBlocks(input, output, layout.blocks, dtype,
                                                   GradientReduceOp(), options_.collective_timeout);
  LeaveCollective(kReduceStream);
  if (!s.ok()) {
    return absl::Status(s.code(),
                        absl::StrCat("reduce_scatter of ", Where(unit), ": ", s.message()));
  }
  return absl::OkStatus();
}

absl::StatusOr<TrackedBuffer> ZeroEngine::GradientOnTheWire(int unit, const float* grads_flat,
                                                            DType held, bool packed) {
  const UnitLayout& layout = units_[unit];
  if (!packed && held == DType::kF32) return TrackedBuffer();  // the flat gradient itself
  const int64_t elements =
      packed ? reduce_comm_->world_size() * layout.chunk_elements : layout.flat_elements;
  absl::StatusOr<TrackedBuffer> wire = buffers_.reduce_wire.Lend(
      MemoryCategory::kCommBuffers, Bytes(elements, held), /*zero=*/false);
  if (!wire.ok()) return wire.status();
  if (packed) {
    backend_->Pack(layout.packed, grads_flat, wire->data(), held);
  } else {
    backend_->Convert(grads_flat, DType::kF32, wire->data(), held, elements);
  }
  return wire;
}

absl::StatusOr<TrackedBuffer> ZeroEngine::LendReceived(int unit, DType held) {
  const int64_t bytes = Bytes(units_[unit].chunk_elements, held);
  // The replicas' all-reduce adds whole chunks: padding must hold zeros.
  const bool zero = replica_comm_ != nullptr;
  if (per_step_replicas() && replica_thread_ != nullptr) {  // given back by its tasks
    return LendWaiting(buffers_.received, MemoryCategory::kCommBuffers, bytes, zero,
                       replica_thread_.get());
  }
  return buffers_.received.Lend(MemoryCategory::kCommBuffers, bytes, zero);
}

absl::Status ZeroEngine::AverageAndFinish(int unit, TrackedBuffer received, bool direct,
                                          bool last_micro, Int8Rounding replica_rounding) {
  UnitState& state = *state_[unit];
  // Decided here, on the reduce thread, before the next micro-batch's
  // reduction of this unit looks at it.
  const bool stale = state.grads_stale;
  if (stage_.grads_sharded) state.grads_stale = false;  // stage 1: the compute thread's
  if (!per_step_replicas()) {  // one group, or DiLoCo (the groups' own gradients)
    return FinishReduction(unit, &received, direct, stale, last_micro);
  }
  if (replica_thread_ == nullptr) {
    void* data = direct ? state.grads.data() : received.data();
    if (absl::Status s = AverageOverReplicas(unit, data, options_.reduce_dtype, replica_rounding);
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
    if (absl::Status s = AverageOverReplicas(unit, data, options_.reduce_dtype, replica_rounding);
        !s.ok()) {
      return s;
    }
    absl::Status s = FinishReduction(unit, held_chunk.get(), direct, stale, last_micro);
    held_chunk->Reset();  // back to the pool before the task counts as done
    return s;
  });
  return absl::OkStatus();
}

absl::Status ZeroEngine::FinishReduction(int unit, TrackedBuffer* received, bool direct, bool stale,
                                         bool last_micro) {
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
  assert(received->bytes() >= Bytes(chunk, held) && "the received chunk holds the unit's chunk");
  if (stage_.reduce_at_step) {
    // One reduction per unit and step (phase order: the last micro-batch's);
    // zeroed, since the norm and the optimizer read the padding too.
    assert(state.reduced.empty() && "a unit's reduced chunk is lent once per step");
    absl::StatusOr<TrackedBuffer> reduced = buffers_.reduced.Lend(
        MemoryCategory::kGradsTransient, Bytes(chunk, DType::kF32), /*zero=*/true);
    if (!reduced.ok()) return reduced.status();
    state.reduced = std::move(*reduced);
  }
  for (int i : layout.own_segments) {
    const Segment& seg = layout.segments[i];
    assert(seg.chunk_offset >= 0 && seg.chunk_offset + seg.length <= chunk &&
           "a piece lies inside its chunk");
    const void* from = At(received->data(), seg.chunk_offset, held);
    if (stage_.reduce_at_step) {
      backend_->Convert(from, held, state.reduced.f32() + seg.chunk_offset, DType::kF32,
                        seg.length);
    } else if (stale) {
      backend_->Convert(from, held, state.grads.f32() + seg.chunk_offset, DType::kF32, seg.length);
    } else {
      backend_->AddInto(from, held, state.grads.f32() + seg.chunk_offset, seg.length);
    }
  }
  if (absl::Status s = norm_of_shard(); !s.ok()) return s;
  return backend_->Synchronize();
}

}  // namespace zeroshard
