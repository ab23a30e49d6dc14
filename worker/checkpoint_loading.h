// Filling a generation's engine from a checkpoint: the reader that --resume
// or --init_from name, and the load itself (parameters, optimizer moments and
// step). The recovery tiers (worker/recovery/) hand their readers to the same
// load.
#ifndef ZEROSHARD_WORKER_CHECKPOINT_LOADING_H_
#define ZEROSHARD_WORKER_CHECKPOINT_LOADING_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "worker/checkpoint/shard_checkpoint.h"
#include "worker/worker_config.h"
#include "worker/zero/engine.h"

namespace zeroshard {

// The reader a fresh job starts from: --resume (latest or a step; the step
// must be complete, NOT_FOUND / FAILED_PRECONDITION saying which) of `job`
// under `root` as `rank` of `world`, or --init_from's file. Null: neither
// was asked, start from the seed.
absl::StatusOr<std::unique_ptr<CheckpointReader>> OpenInitialCheckpoint(const InitialState& initial,
                                                                        const std::string& root,
                                                                        const std::string& job,
                                                                        int rank, int world);

// What a checkpoint says about where training stands.
struct LoadedPosition {
  int64_t step = 0;       // the step it was saved after (0: not recorded)
  int64_t data_row = -1;  // the data cursor's row (-1: not recorded)
};

// Fills `engine` from `reader`: the parameters, and the moments and the
// optimizer's step when the reader has them and `options`' optimizer keeps
// them; a DiLoCo engine's outer state (anchor, outer momentum, outer step)
// when the reader has it, else it starts fresh. `log_notes`: say on stderr
// when moments or the outer state start at zero or go unused (rank 0).
absl::StatusOr<LoadedPosition> LoadEngineState(CheckpointReader* reader, ZeroEngine& engine,
                                               const EngineOptions& options, bool log_notes);

}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_CHECKPOINT_LOADING_H_
