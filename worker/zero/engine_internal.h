// The engine's private pieces shared by its files (engine.h's ZeroEngine is
// cut along its seams: engine.cc the core and the unit walk, engine_setup.cc
// the layouts and buffers planned at Create, engine_gather.cc the gathers,
// engine_reduce.cc the reductions, engine_step.cc the norm and the update,
// engine_state.cc the state in and out). Not for use outside worker/zero.
#ifndef ZEROSHARD_WORKER_ZERO_ENGINE_INTERNAL_H_
#define ZEROSHARD_WORKER_ZERO_ENGINE_INTERNAL_H_

#include <cstdint>
#include <memory>
#include <optional>

#include "absl/status/status.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/dtype.h"
#include "worker/zero/engine.h"

namespace zeroshard {
namespace engine_internal {

inline int64_t Bytes(int64_t elements, DType dtype) { return elements * DTypeSize(dtype); }

inline double MsSince(absl::Time start) { return absl::ToDoubleMilliseconds(absl::Now() - start); }

inline char* At(void* base, int64_t element, DType dtype) {
  return static_cast<char*>(base) + element * DTypeSize(dtype);
}

// Create's checks of the options against the plan and the communicators.
absl::Status ValidateOptions(const EngineOptions& options, const ShardPlan& plan,
                             const Communicator* gather, const Communicator* reduce,
                             const Communicator* aux);
// DiLoCo's checks (engine_outer.cc): `replicas` groups, the outer options.
absl::Status ValidateOuterOptions(const EngineOptions& options, int replicas);

}  // namespace engine_internal

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
  // DiLoCo (engine_outer.cc): the parameters of the last outer step (chunk
  // f32, the master shard's layout), the outer SGD over it (its momentum),
  // and, with a bf16, int8 or int4 outer dtype, the quantization residual of this
  // rank's last outer gradient (error feedback). Empty without DiLoCo.
  TrackedBuffer anchor;
  std::unique_ptr<Optimizer> outer_optimizer;
  TrackedBuffer outer_residual;
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

}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_ZERO_ENGINE_INTERNAL_H_
