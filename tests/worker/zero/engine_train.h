// The engine tests' harness (engine_test, engine_packed_test): an MLP
// trained by the ZeRO engine with real Gloo communicators, ranks as threads
// in one process, and the error model's bound for how far two such runs may
// be apart when they differ only in the order of their sums.
#ifndef ZEROSHARD_TESTS_WORKER_ZERO_ENGINE_TRAIN_H_
#define ZEROSHARD_TESTS_WORKER_ZERO_ENGINE_TRAIN_H_

#include <atomic>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "common/plan/shard_plan.h"
#include "tests/testing/params.h"
#include "worker/zero/backend.h"

namespace zeroshard {
namespace engine_testing {

inline constexpr double kLr = 1e-2;

struct RunConfig {
  int world = 2;
  int stage = 3;
  int prefetch = 1;
  int grad_accum = 1;
  int batch = 4;  // rows per rank per micro-batch
  int steps = 5;
  int layers = 4;
  int width = 24;
  DType param_dtype = DType::kF32;
  DType reduce_dtype = DType::kF32;
  std::string optimizer = "adam";
  bool shared_gather = true;   // EngineOptions::shared_gather (the communicators use shm)
  std::optional<bool> packed;  // EngineOptions::packed_collectives
  Backend* backend = nullptr;  // EngineOptions::backend (nullptr: the host's)
  // Rank 1's batch of this step holds a NaN (the step must change nothing);
  // -1: none.
  int nan_step = -1;
  // This step's data is left out entirely (no forward, no Step): the run a
  // skipped step must equal; -1: none.
  int drop_step = -1;
  int max_grad_norm = 0;
  // The ranks whose micro-batches the `world` ranks share
  // (worker/data/batch_layout.h: a generation shrunk from data_world under
  // --keep_global_batch); 0: world (each rank its own grad_accum).
  int data_world = 0;
  // hpZ: secondary groups of this many consecutive ranks (EngineOptions::
  // secondary); 0: none.
  int secondary = 0;
  // When set: counts the secondary communicators' plain AllGather calls.
  std::atomic<int>* secondary_all_gathers = nullptr;
};

struct RankResult {
  int64_t model_state = 0;
  int64_t peak_gathered = 0;
  int64_t peak_comm_buffers = 0;
  int64_t pool_cached = 0;  // every pool's buffers, as planned at Create
  int64_t largest_unit_bytes = 0;
  int64_t gather_bytes = 0;  // sent by the all-gathers of the whole run
  // Buffers allocated from the first micro-batch to the end of the last
  // step (the step path lends only buffers planned at Create).
  int64_t step_allocations = 0;
  std::vector<double> losses;
  std::vector<int> nonfinite_steps;  // steps whose verdict was not finite
};

struct RunResult {
  testing::Params params;  // the full model after training
  double params_sum = 0;
  std::vector<RankResult> ranks;
  ShardPlan plan;
};

// Trains `config` (every rank a thread) and returns the full model and
// what each rank saw.
RunResult Train(const RunConfig& config);

// How far a run may be from `reference` when the two differ only in the
// order of their float32 sums (OpenBLAS's kernels block the products
// differently per CPU; W ranks reduce in ring order; micro-batches add partial
// gradients): tests/testing/error_model.h's Adam bound for this MLP, relative
// to each tensor's scale (what MaxRelativeDifference measures). E.g. the
// default config (4 layers, width 24, 16 rows, 5 steps, lr 1e-2, smallest
// tensor scale ~0.2): ~1e-3, where a lost micro-batch, a wrong shard offset or
// a missing average moves parameters by >= lr / scale = 5e-2.
double Tolerance(const RunConfig& c, const RunResult& reference);

}  // namespace engine_testing
}  // namespace zeroshard

#endif  // ZEROSHARD_TESTS_WORKER_ZERO_ENGINE_TRAIN_H_
