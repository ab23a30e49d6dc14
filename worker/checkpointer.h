// Saves this rank's shard of a training run's checkpoints. The snapshot of the
// engine's state is the training thread's pause; the write, the upload
// (--checkpoint_transport=grpc) and the commit run on a thread of their own,
// one checkpoint in flight at a time. See docs/design.md, "Checkpoint formats".
//
// Not thread-safe: the training thread calls it. Destroying it waits for the
// checkpoint in flight.
#ifndef ZEROSHARD_WORKER_CHECKPOINTER_H_
#define ZEROSHARD_WORKER_CHECKPOINTER_H_

#include <string>
#include <vector>

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
  // snapshots `engine` as `id` and queues the rest.
  absl::Status Save(ZeroEngine& engine, const ShardIdentity& id);

  // Waits for the last checkpoint ("checkpoint: ...").
  absl::Status Drain();

 private:
  Client* const client_;
  const CheckpointConfig config_;
  const std::string optimizer_;
  std::vector<double>* const pause_ms_;
  TaskThread thread_{"checkpoint"};
};

}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_CHECKPOINTER_H_
