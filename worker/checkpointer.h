// Saves this rank's shard of a training run's checkpoints. The snapshot of the
// engine's state is the training thread's pause; the write, the upload
// (--checkpoint_transport=grpc) and the commit run on a thread of their own,
// one checkpoint in flight at a time. See docs/design.md, "Checkpoint formats".
//
// A checkpoint that cannot be saved while a later one is due (a full disk
// here or under the server's root: RESOURCE_EXHAUSTED; a step another rank
// abandoned: ABORTED) is abandoned for every rank through the server and
// training goes on; the next interval tries again. Any other failure, or
// one of the last scheduled checkpoint, ends the run as before.
//
// Not thread-safe: the training thread calls it. Destroying it waits for the
// checkpoint in flight.
#ifndef ZEROSHARD_WORKER_CHECKPOINTER_H_
#define ZEROSHARD_WORKER_CHECKPOINTER_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"

#include "absl/status/status.h"
#include "client/client.h"
#include "worker/checkpoint/shard_checkpoint.h"
#include "worker/worker_config.h"
#include "worker/zero/engine.h"
#include "worker/zero/task_thread.h"

namespace zeroshard {

class Checkpointer {
 public:
  // `client` and `pause_ms` outlive it; each Save appends its pause (ms) to
  // `pause_ms`.
  Checkpointer(Client* client, const CheckpointConfig& config, const std::string& optimizer,
               std::vector<double>* pause_ms);

  // Waits for the previous checkpoint ("previous checkpoint: ..."), then
  // snapshots `engine` as `id` and queues the rest. `retry_step`: the step
  // at which the next checkpoint is due (0: none), where a failed one is
  // tried again.
  absl::Status Save(ZeroEngine& engine, const ShardIdentity& id, int64_t retry_step);
  // Whether a checkpoint failed with `s` is one training outlives: a full
  // disk (ours or the server's root), or a step another rank abandoned.
  static bool TrainingOutlives(const absl::Status& s);

  // Waits for the last checkpoint ("checkpoint: ...").
  absl::Status Drain();

  // "checkpoint step N failed on rank R: ...; retrying at step M", one per
  // abandoned checkpoint so far. Thread-safe.
  std::vector<std::string> failures() const;

 private:
  // What the background thread appends to.
  struct Failures {
    mutable absl::Mutex mu;
    std::vector<std::string> messages ABSL_GUARDED_BY(mu);
  };
  // The background half of Save: WriteAndCommit, and for a failure that
  // training outlives (see above) the abandonment, when a later checkpoint
  // is due (`retry_step` > 0).
  static absl::Status SaveOrAbandon(const ShardSnapshot& snapshot, Client* client,
                                    const CheckpointConfig& config, int64_t retry_step,
                                    Failures* failures);

  Client* const client_;
  const CheckpointConfig config_;
  const std::string optimizer_;
  std::vector<double>* const pause_ms_;
  const std::shared_ptr<Failures> failures_ = std::make_shared<Failures>();
  TaskThread thread_{"checkpoint"};
};

}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_CHECKPOINTER_H_
