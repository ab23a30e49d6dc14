// What a ZeroEngine is created with (engine.h): the stage, prefetch, dtypes
// on the wire, the optimizer, and the communicators beside the gather and
// reduce ones (shard groups' replicas, hpZ's secondary group).
#ifndef ZEROSHARD_WORKER_ZERO_ENGINE_OPTIONS_H_
#define ZEROSHARD_WORKER_ZERO_ENGINE_OPTIONS_H_

#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include "absl/time/time.h"
#include "common/dtype.h"
#include "worker/comm/communicator.h"
#include "worker/zero/backend.h"
#include "worker/zero/optimizer.h"

namespace zeroshard {

// How the shard groups' replicas of a shard stay together (--sync).
enum class ReplicaSync {
  // Every step's reduced gradient shard is averaged over the replicas, so
  // the groups take the same steps (HSDP).
  kEveryStep,
  // DiLoCo (Douillard et al. 2023): each group steps its own inner optimizer
  // on its own gradients; every `OuterOptions::every` steps the groups
  // average their parameter change since the last outer step (the outer
  // gradient) and an outer Nesterov SGD moves the shared anchor
  // (ZeroEngine::OuterStep, engine_outer.cc).
  kDiLoCo,
};

// How DiLoCo's outer all-reduce sends the outer gradient (--outer_dtype):
// f32, bf16 (the comm's own dtype), or int8 / int4 blocks of values with
// one f32 scale each (worker/comm/quantized.h). Not a DType: 4 bits is no
// tensor dtype of this project, only a wire format.
enum class OuterWire { kF32, kBF16, kInt8, kInt4 };

// The flag's and the reports' name: "f32", "bf16", "int8", "int4".
inline const char* OuterWireName(OuterWire wire) {
  switch (wire) {
    case OuterWire::kF32:
      return "f32";
    case OuterWire::kBF16:
      return "bf16";
    case OuterWire::kInt8:
      return "int8";
    case OuterWire::kInt4:
      return "int4";
  }
  return "unknown";
}

// Whether the wire is block-quantized (int8, int4): quantized on host
// memory, to nearest, through worker/comm/quantized.h.
inline bool QuantizedOuterWire(OuterWire wire) {
  return wire == OuterWire::kInt8 || wire == OuterWire::kInt4;
}

// DiLoCo's outer step (--outer_every, --outer_lr, --outer_momentum,
// --outer_dtype).
struct OuterOptions {
  int every = 50;         // H: inner steps per outer step (the worker's schedule)
  double lr = 0.7;        // the outer SGD's learning rate
  double momentum = 0.9;  // Nesterov momentum; 0: plain SGD
  // The outer all-reduce's wire: f32, bf16, int8 or int4 (worker/comm/
  // quantized.h). All but f32 keep each rank's quantization residual and
  // add it to the next outer gradient (error feedback).
  OuterWire wire = OuterWire::kF32;
  // Streaming DiLoCo (Douillard et al. 2025, "Streaming DiLoCo with
  // overlapping communication"; --outer_fragments, --outer_delay,
  // --outer_mix; engine_outer_stream.cc): the units split into `fragments`
  // contiguous runs balanced by parameter count, each synced on its own
  // (ZeroEngine::BeginOuterFragment / FinishOuterFragment), its all-reduce
  // on the replica thread while the compute thread trains on; the worker
  // begins one every every / fragments steps and finishes it `delay` steps
  // later. When finished, the fragment's parameters become
  // anchor + mix (params - anchor): the outer result moved `mix` of the way
  // to this group's parameters of the moment (the paper's alpha; 0: the
  // outer result overwrites them). The engine
  // plans the fragments' buffers when fragments > 1 or delay > 0.
  int fragments = 1;
  int delay = 0;
  double mix = 0.5;
};

struct EngineOptions {
  int stage = 3;
  int prefetch = 1;
  DType param_dtype = DType::kF32;   // dtype of gathered / replicated parameters
  DType reduce_dtype = DType::kF32;  // dtype gradients are reduced in
  // kI8 (--reduce_dtype=int8): gradients stay f32 in memory and travel
  // int8 block-quantized (worker/comm/quantized.h: the reduce-scatter
  // through an all-to-all, the replicas' and stage 0's all-reduce through an
  // all-gather), each value quantized once per collective. Host memory only.
  // gather_dtype kI8 (--gather_dtype=int8, stage 3 with f32 parameters):
  // each owner quantizes its f32 master shard once per gather and every
  // rank computes on the dequantized unit; the master stays f32. Otherwise
  // (kF32) gathers travel in param_dtype.
  DType gather_dtype = DType::kF32;
  // Int8 reductions (--int8_reduce_rounding): false, to nearest; true,
  // stochastic rounding, unbiased, so gradients below half a block's
  // quantum are not lost every step (docs/quantized_comm.md: not shown to
  // train the quickstart better, and it costs CPU). Gathers always round to
  // nearest: the master weights stay f32, only their copy is rounded.
  bool int8_stochastic_reduce = false;
  // Shard groups with --reduce_dtype=int8: the group's reduce-scatter in
  // f32 (set when it runs over shared memory: nothing of it crosses a link)
  // and only the replicas' all-reduce quantized; one quantization per
  // gradient instead of two, and no all-to-all over TCP inside the host.
  bool int8_group_reduce_in_f32 = false;
  // Micro-batch passes per optimizer step, the same on every rank: each is
  // a ForwardBackward or a PadMicroBatch (stages 2-3 reduce, and stage 3
  // gathers, once per pass).
  int grad_accum = 1;
  // The step's micro-batches over all ranks, when ranks carry different
  // numbers of them (--keep_global_batch after a shrink to a world size that
  // does not divide them: worker/data/batch_layout.h): the reductions then
  // sum, and the step scales the sum by 1 / global_micro_batches, so every
  // micro-batch weighs what it did in the run the layout comes from; ranks
  // with fewer micro-batches pad with PadMicroBatch. 0: every pass carries
  // data; the reductions average over the W ranks and the step over the
  // grad_accum micro-batches, as always.
  int64_t global_micro_batches = 0;
  absl::Duration collective_timeout = absl::Seconds(60);
  // Test-only (shard_worker's --test_* flags): runs on a collective's thread
  // just before it enters collective number `seq` of its stream; `op` is
  // "all_gather", "reduce_scatter" or "all_reduce".
  std::function<void(const char* op, int64_t seq)> before_collective;
  std::string optimizer = "adam";
  OptimizerOptions optimizer_options;
  double max_grad_norm = 0;  // > 0: clip by global norm
  // Stage 3 with f32 parameters on the host: gather into buffers every rank
  // of the host reads in place, when the gather communicator offers them
  // (Communicator::MakeSharedGather: shared memory); else, or when false,
  // into this rank's own buffers.
  bool shared_gather = true;
  // Stage 3's gathers, stages 1-2's parameter sync and stages 1-3's
  // reduce-scatters of whole units (not int8, not into shared regions)
  // through a packed buffer: the plain AllGather / ReduceScatter over W
  // chunks, and one Backend::Pack or Unpack between the chunks and the
  // unit's flat layout (packed_layout.h), instead of the block collectives;
  // and hpZ's gathers from the secondary shards as one plain AllGather
  // straight into the unit (the slices are consecutive in flat order).
  // Unset: on device backends (NCCL, whose block collectives stage the data
  // and copy block by block), off on the host (Gloo and shared memory move
  // blocks in place). Set: that, on any backend (the tests' way to run the
  // device path on the CPU). The same bits either way.
  std::optional<bool> packed_collectives;
  // Where buffers live and the non-model ops run; null: the CPU. The model's
  // views point into this backend's memory. Not owned.
  Backend* backend = nullptr;
  // Hybrid sharding (the plan has shard groups of G < W ranks): the
  // communicator over this rank's W / G replicas (the ranks holding the same
  // shard in the other groups), over which each reduced gradient shard is
  // averaged after the group's reduce-scatter. Null without groups. Not
  // owned; used by the reduce thread only.
  Communicator* replicas = nullptr;
  // The ranks each step's loss, gradient norm and finite verdict are agreed
  // over (ShareStepNumerics); null: `aux`, all W. Elastic DiLoCo
  // (--outer_timeout) gives the shard group's own communicator (G ranks,
  // this rank's member index its rank), so the groups are not coupled
  // between outer steps: the loss is then the group's. Not owned.
  Communicator* numerics = nullptr;
  // Shard groups: the replicas' all-reduce on a thread of its own (see
  // Threads above); false: on the reduce thread after each reduce-scatter,
  // as before (for comparisons: multihost_bench's hsdp-serial mode).
  bool replica_thread = true;
  // Shard groups: every step (HSDP) or DiLoCo's outer steps (see
  // ReplicaSync). kDiLoCo needs replicas; the replica thread then runs only
  // streaming fragments' all-reduces (OuterOptions::fragments), and the
  // step's gradient norm (and clipping) is the group's own.
  ReplicaSync replica_sync = ReplicaSync::kEveryStep;
  OuterOptions outer;  // kDiLoCo only
  // hpZ (stage 3): the communicator over this rank's secondary group of H
  // ranks (consecutive ranks, those of a host), over which the backward's
  // gathers run (see hpZ above); null: off. Not owned; used by the gather
  // thread only.
  Communicator* secondary = nullptr;
};

}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_ZERO_ENGINE_OPTIONS_H_
