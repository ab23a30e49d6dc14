// Saves this rank's shard of a training run's checkpoints without pausing
// training (#45): on a host backend the writer thread copies the engine's own
// state (a ShardView) while the next step's forward and backward run, and the
// training thread waits only before the next optimizer update would change
// that state (WaitCopied), normally not at all. With --checkpoint_staging
// (the default) the copy is a memcpy into a host buffer the checkpointer
// keeps (its pages faulted in once, by the first checkpoint), and write(2)
// reads that buffer after the update may go on: the copy takes ~0.1 s for a
// 576 MiB shard where write(2) into the page cache took ~0.4 s, longer than
// a step's forward and backward on 2 cores. Off, write(2) reads the engine's
// memory. On a device backend the copy to the host is the pause. The write runs on that
// thread too (one write in flight), and the upload (--checkpoint_transport=
// grpc) and the commit on another, in step order. See docs/design.md,
// "Checkpoint formats".
//
// Training never waits for the control plane: a commit needs the server (and
// its etcd quorum), a write only this rank's disk. While the server is out of
// reach (a partition, a failover, etcd without quorum) written checkpoints
// wait for their commits, which go through in order once it answers; the
// training thread waits only for the previous write. At most
// --max_pending_commits wait: past that the oldest one not yet being
// committed is dropped (said on stderr), its file removed and its step
// abandoned for every rank once the server answers.
//
// A checkpoint that cannot be saved while a later one is due (a full disk
// here or under the server's root: RESOURCE_EXHAUSTED; a step another rank
// abandoned: ABORTED) is abandoned for every rank through the server and
// training goes on; the next interval tries again. Any other failure, or
// one of the last scheduled checkpoint, ends the run as before (at the next
// Save or at Drain).
//
// Save and Drain: the training thread. pending_commits and failures: any
// thread. Destroying it waits for the writes and commits in flight.
#ifndef ZEROSHARD_WORKER_CHECKPOINTER_H_
#define ZEROSHARD_WORKER_CHECKPOINTER_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
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
  ~Checkpointer();

  // Waits for the previous checkpoint's write ("previous checkpoint: ..."),
  // returns a commit's failure that ends the run, then snapshots `engine` as
  // `id` and queues the write and the commit. `retry_step`: the step at
  // which the next checkpoint is due (0: none), where a failed one is tried
  // again.
  // `on_device`: the engine's state is not host memory (copied here).
  // REQUIRES: WaitCopied before anything changes the engine's master values
  // or moments (its next Step, a restore).
  absl::Status Save(ZeroEngine& engine, const ShardIdentity& id, int64_t retry_step,
                    bool on_device = false);
  // --checkpoint_staging on a host backend: allocates the staging buffer for
  // `engine`'s shard and faults its pages in, on the writer thread (the
  // training thread does not wait). Optional: Save grows it as needed.
  void Reserve(ZeroEngine& engine, const ShardIdentity& id);
  // Returns once the last Save's state is copied out of the engine (at
  // once if it is); the wait is added to that Save's pause. Training thread.
  void WaitCopied();
  // Whether a checkpoint failed with `s` is one training outlives: a full
  // disk (ours or the server's root), or a step another rank abandoned.
  static bool TrainingOutlives(const absl::Status& s);

  // Waits for the last write and every commit ("checkpoint: ...").
  absl::Status Drain();

  // "checkpoint step N failed on rank R: ...; retrying at step M", one per
  // abandoned checkpoint so far. Thread-safe.
  std::vector<std::string> failures() const;
  // --checkpoint_staging's buffer (0: none yet). Thread-safe.
  int64_t staging_bytes() const { return staging_bytes_.load(std::memory_order_relaxed); }
  // Checkpoints written and not yet committed (or abandoned). Thread-safe.
  int pending_commits() const;
  // Per committed checkpoint, ms from its Save to its commit: how long a
  // step takes to become restorable. Thread-safe.
  std::vector<double> commit_ms() const;

 private:
  // Queued on the committer thread by a write: upload, commit.
  absl::Status Commit(const ShardIdentity& id, const WrittenShard& written, int64_t retry_step,
                      absl::Time saved_at);
  // The writer's task for one Save: the copy (signalling `copied`), the
  // write, then the commit queued.
  absl::Status Write(const ShardView& view, absl::Notification& copied, int64_t retry_step,
                     absl::Time saved_at);
  // For a failure `saved` that training outlives: removes the file nobody
  // will name, tells the server (unless it told us: ABORTED), and notes the
  // failure when a later checkpoint is due; otherwise returns `saved`.
  absl::Status Abandon(const ShardIdentity& id, const std::string& written_path,
                       const absl::Status& saved, int64_t retry_step);
  // --checkpoint_staging: copies `view`'s values into staging_ (grown to
  // fit), notifies `copied`, and returns a view of the copies.
  ShardView Stage(const ShardView& view, absl::Notification& copied);
  void Grow(int64_t floats);  // staging_ holds at least `floats` (writer thread)
  // After a write: past --max_pending_commits, drops the oldest waiting step.
  void NoteWritten(int64_t step, int rank);

  Client* const client_;
  const CheckpointConfig config_;
  const std::string optimizer_;
  std::vector<double>* const pause_ms_;

  mutable absl::Mutex mu_;
  std::vector<std::string> failures_ ABSL_GUARDED_BY(mu_);
  std::deque<int64_t> waiting_ ABSL_GUARDED_BY(mu_);  // written, commit not begun; oldest first
  std::set<int64_t> dropped_ ABSL_GUARDED_BY(mu_);    // of waiting_, dropped for the bound
  int committing_ ABSL_GUARDED_BY(mu_) = 0;           // commits begun, not finished
  std::vector<double> commit_ms_ ABSL_GUARDED_BY(mu_);
  // The last Save's copy, until WaitCopied saw it done (training thread).
  std::shared_ptr<absl::Notification> copied_;
  // --checkpoint_staging's buffer (writer thread), kept across checkpoints.
  std::unique_ptr<float[]> staging_;
  int64_t staging_floats_ = 0;
  std::atomic<int64_t> staging_bytes_{0};  // staging_floats_ in bytes, for other threads

  // The committer before the writer: the writer (destroyed first) may queue
  // a commit while it finishes.
  TaskThread committer_{"ckpt-commit"};
  TaskThread writer_{"checkpoint"};
};

}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_CHECKPOINTER_H_
