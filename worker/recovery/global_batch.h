// --keep_global_batch (#45 item 3): how many micro-batches each rank of a
// generation accumulates per optimizer step so that a job that shrank keeps
// the global batch and the sample order of its original world size.
//
// The data layout (worker/data/regression_data.h) puts micro-batch m of rank
// r at step s on global rows ((s * A + m) * W + r) * b: a step is W * A
// micro-batches of b rows, numbered k = m * W + r in row order. A job of W0
// ranks that shrank to W' ranks keeps that step when W' divides W0 * A: each
// survivor accumulates A' = W0 * A / W' micro-batches, and micro-batch m' of
// survivor r' is number k = m' * W' + r', i.e. the rows original rank
// k mod W0 took in its micro-batch k / W0. The formula above with (W', A')
// gives exactly those rows, so the data code needs nothing but A'. The step's
// gradient is the engine's average over ranks (the reduction's divisor W')
// and over micro-batches (1 / A'): 1 / (W' A') = 1 / (W0 A) of the sum over
// the original global batch, the loss scaling of the original run.
//
// When W' does not divide W0 * A the ranks would have to do different
// numbers of micro-batches (and of collectives); that is not built: the
// generation keeps the per-rank batch (A micro-batches) and the global batch
// shrinks, as with --keep_global_batch=false, and the worker says so.
#ifndef ZEROSHARD_WORKER_RECOVERY_GLOBAL_BATCH_H_
#define ZEROSHARD_WORKER_RECOVERY_GLOBAL_BATCH_H_

#include <string>
#include <vector>

namespace zeroshard {

struct GlobalBatchPlan {
  int grad_accum = 1;  // micro-batches per rank per step in this generation
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

// The world sizes from `min_world` (--min_world_size; 0: none) up to
// original_world - 1 that do not divide original_world x grad_accum: the
// shrinks after which the global batch could not be kept. For a line at the
// job's start, so a launcher learns it before a failure.
std::vector<int> SizesThatCannotKeepTheGlobalBatch(int original_world, int min_world,
                                                   int grad_accum);

}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_RECOVERY_GLOBAL_BATCH_H_
