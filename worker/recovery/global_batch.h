// --keep_global_batch (#45 item 3): which micro-batches each rank of a
// generation trains per optimizer step so that a job that shrank keeps the
// global batch, the sample order and the loss scaling of its original world
// size.
//
// The data layout (worker/data/regression_data.h) puts micro-batch m of rank
// r at step s on global rows ((s * A + m) * W + r) * b: a step is N = W * A
// micro-batches of b rows, numbered k = m * W + r in row order. A job of W0
// ranks that shrank to W' ranks keeps that step: the survivors take its N
// micro-batches round-robin (worker/data/batch_layout.h), survivor r'
// training k = m' * W' + r' for m' = 0, 1, ... while k < N, i.e. the rows
// original rank k mod W0 took in its micro-batch k / W0.
//
// When W' divides N every survivor trains A' = N / W' micro-batches; the
// engine averages over its W' ranks (the reductions' divisor) and over the
// A' micro-batches: 1 / (W' A') = 1 / N of the sum over the original global
// batch, as before the shrink. When it does not (4 -> 3 ranks at A = 1,
// 800 -> 792), the first N mod W' survivors train ceil(N / W') micro-batches
// and the others one fewer, padding with a pass that carries no data (the
// collectives of stages 2-3 are per pass: ZeroEngine::PadMicroBatch); the
// reductions then sum and the step divides by N
// (EngineOptions::global_micro_batches), and the step's loss is the mean
// over the N micro-batches (each rank's weighted by its count): again the
// original run's scaling. Either way the result differs from the original
// run's only in the order the N micro-batch gradients are added
// (docs/recovery.md states the bound).
//
// With --keep_global_batch=false each rank keeps its A micro-batches and
// the global batch shrinks with W.
#ifndef ZEROSHARD_WORKER_RECOVERY_GLOBAL_BATCH_H_
#define ZEROSHARD_WORKER_RECOVERY_GLOBAL_BATCH_H_

#include <string>

#include "worker/data/batch_layout.h"

namespace zeroshard {

struct GlobalBatchPlan {
  // The generation's micro-batches: layout.world is its size, and the rows
  // follow (data_world, data_accum): the original world size's when kept.
  BatchLayout layout;
  // The step is the original world size's: same rows, same loss scaling.
  bool kept = true;
  // For the worker's log, naming the sizes; "" when the generation has the
  // original world size (nothing to say).
  std::string note;
};

// `keep`: --keep_global_batch. `original_world`: the job's --world_size (the
// size it was started with, which every member joins with and the server
// keeps as the target across shrinks and restarts). `world`: this
// generation's. `grad_accum`: --grad_accum. `batch`: rows (or sequences) per
// micro-batch, for the note. REQUIRES: 1 <= world, original_world, grad_accum.
GlobalBatchPlan PlanGlobalBatch(bool keep, int original_world, int world, int grad_accum,
                                int batch);

}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_RECOVERY_GLOBAL_BATCH_H_
