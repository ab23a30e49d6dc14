// shard_worker's DiLoCo flags (--sync, --outer_every, --outer_lr,
// --outer_momentum, --outer_dtype; streaming's --outer_fragments,
// --outer_delay, --outer_mix): read into WorkerConfig::engine's
// replica_sync and outer options, and checked against the flags they
// combine with (the shard groups, checkpoints, snapshots, replica checks).
// docs/diloco.md says what DiLoCo is and what it does not do yet.
#ifndef ZEROSHARD_WORKER_OUTER_SYNC_CONFIG_H_
#define ZEROSHARD_WORKER_OUTER_SYNC_CONFIG_H_

#include "absl/status/status.h"
#include "worker/worker_config.h"

namespace zeroshard {

// --outer_timeout: the most shard groups an outer quorum names (a bit each
// in a 63-bit mask; worker_outer_elastic.cc).
constexpr int kMaxOuterQuorumGroups = 62;

// After the other flags are read (WorkerConfigFromFlags): INVALID_ARGUMENT
// naming the flag, the value and what to set. With --sync=diloco and
// --snapshot_every at its default value, the snapshots move to the outer
// steps (every --outer_every steps): only there do the groups hold one model.
absl::Status ReadOuterSync(WorkerConfig* config);

// Whether the worker runs an outer step after `completed` steps of a run of
// `steps`: every `every` steps, and after the last one (so the run ends, and
// its last checkpoint holds, one model).
bool OuterStepAfter(int completed, int steps, int every);

// Streaming DiLoCo (--outer_fragments > 1, or --outer_delay > 0 with one
// fragment): the worker's rotation (worker_outer_stream.cc).
bool StreamingOuter(const OuterOptions& outer);
// Streaming: whether the worker runs a full outer step after `completed`
// steps (the pending fragment finished first): after the last step, and
// at each checkpoint or snapshot step (multiples of --outer_every, where
// the rotation's last fragment was due), so that every checkpoint and
// snapshot holds one model.
bool FullOuterStepAfter(const WorkerConfig& config, int completed);
// Streaming: the fragment whose outer step begins after `completed` steps,
// or -1: fragment p after steps (k F + p + 1) H / F, k >= 0.
int FragmentBeganAfter(int completed, const OuterOptions& outer);

}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_OUTER_SYNC_CONFIG_H_
