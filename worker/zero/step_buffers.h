// Every buffer the engine's step path uses (forward, backward, the
// reductions, the optimizer step), planned and allocated when the engine is
// created (ZeroEngine::Create; the plan is engine_setup.cc's
// PlanStepBuffers): the step path lends from these pools and allocates
// nothing. Sizes follow the largest unit (or each unit's chunk); counts
// follow the schedule and the threads. Lent buffers count in their category
// (memory_tracker.h), idle ones as pool_cached.
#ifndef ZEROSHARD_WORKER_ZERO_STEP_BUFFERS_H_
#define ZEROSHARD_WORKER_ZERO_STEP_BUFFERS_H_

#include "worker/zero/memory_tracker.h"

namespace zeroshard {

struct StepBuffers {
  // Flat gradients beyond the units the backward holds open at once: one
  // being reduce-scattered while the next is written. More only lets the
  // backward run further ahead of the reductions; fewer would stall it.
  static constexpr int kFlatGradientsAhead = 2;
  // Shard groups with a replica thread: reduced chunks waiting for, or in,
  // the replicas' average while the reduce thread goes on inside the group.
  static constexpr int kReplicaChunks = 4;

  // params_gathered, compute thread (and gather tasks writing them): a pass
  // position's full unit, flat f32. Stage 3's gathers into this rank's own
  // buffers (GatherWindow::PeakUnits of them; the units a Step gathers early
  // included), or stages 0-2's f32 copy of bf16 parameters (one).
  BufferPool gathered{"gathered units"};
  // grads_transient: stages 2-3, a unit's flat f32 gradient from its first
  // backward op until the reduce thread's reduce-scatter has read it. The
  // backward waits for one when the reductions fall behind.
  BufferPool flat_grads{"flat gradients"};
  // grads_transient: stage 1, each unit's reduced gradient chunk from the
  // step's reduce-scatter to the unit's update (one per unit, its size).
  BufferPool reduced{"reduced chunks"};
  // comm_buffers, compute thread: stages 1-2's parameter sync, the updated
  // shard packed (f32) or narrowed (bf16) for the all-gather; or, with
  // packed collectives, the one packed buffer of G chunks (f32 or bf16).
  BufferPool sync{"parameter sync"};
  // comm_buffers, gather thread: bf16 gathers, the narrowed shard and the
  // received unit; or, with packed collectives (EngineOptions), the one
  // packed buffer of G chunks (f32 or bf16).
  BufferPool gather_wire{"gather wire"};
  // comm_buffers, reduce thread: bf16 reductions, the narrowed flat gradient
  // (stages 1-3) or stage 0's all-reduce buffer; or, with packed
  // collectives, the packed gradient of G chunks.
  BufferPool reduce_wire{"reduction wire"};
  // comm_buffers, reduce thread: the reduce-scatter's output chunk when it
  // does not land in the gradient shard itself; with a replica thread it
  // waits there for the replicas' average (kReplicaChunks, and the reduce
  // thread waits when the replicas fall behind).
  BufferPool received{"received chunks"};
};

}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_ZERO_STEP_BUFFERS_H_
