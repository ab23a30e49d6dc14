// In-memory snapshots, kept twice (#13): every --snapshot_every steps each
// rank's shard state (master parameters, optimizer moments and step, the
// data cursor in the metadata) goes into a host buffer in the shard-file
// format (safetensors with an XXH64 per tensor), and the blob (with the
// XXH64 of its header, which holds the tensors' XXH64s) is swapped with the buddies over the data
// plane's "snapshot" context: rank r sends its blob to (r + k) mod W and keeps the blob of (r - k)
// mod W, where k is the smallest shift that puts every rank's buddy on another host (1 when the job
// runs on one host). In HSDP with R >= 2 replicas the view also holds the
// replica peer's run and Start gets no communicator: nothing is swapped, and
// a step is complete on a rank as soon as its copy is (SnapshotSchedule).
//
// Off the training thread. The shard state changes only in the optimizer
// step, so the copy out of the engine runs on the keeper's thread while the
// next step's forward and backward run; the training thread only waits
// (WaitCopied) before the next optimizer update, normally long after the
// copy ended. One copy, straight into the blob's buffer (SerializeShardInto),
// and the buffers are reused: a blob dropped by a commit returns its buffer
// to a pool that the next snapshot and the next received copy take from, so
// after the first two snapshots nothing is allocated and no page is touched
// for the first time. A snapshot whose predecessor's transfer is still in
// flight on some rank is skipped by every rank (the Worker decides that
// together with the commit), never waited for.
//
// Commit. A step counts as committed when every rank holds its own blob and
// its buddy's verified copy of that step. Ranks agree with one small
// collective (a min over ranks of complete_step(), on the engine's aux
// communicator) at the next snapshot boundary, before taking the new one;
// blobs older than the committed step are then dropped. So a rank keeps at
// most two steps of its own blobs and two of its buddy's: the previous
// committed snapshot stays valid until the next one is complete on both
// holders. (A KV-store counter would need the server on every commit; the
// collective rides the data plane the step already uses.)
//
// Blobs live across job generations (they are the process's memory), named
// by the rank and world size of the generation that saved them.
//
// Thread-safe.
#ifndef ZEROSHARD_WORKER_RECOVERY_SNAPSHOT_KEEPER_H_
#define ZEROSHARD_WORKER_RECOVERY_SNAPSHOT_KEEPER_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "worker/checkpoint/shard_checkpoint.h"
#include "worker/comm/gloo_communicator.h"
#include "worker/recovery/recovery_decision.h"
#include "worker/zero/task_thread.h"

namespace zeroshard {

// One rank's shard state at a step: its bytes, and what the recovery's
// agreement is told of it (step, saver's rank and plan, data row, size,
// checksum, pieces, whether received). The keeper sets description.bytes
// and description.xxh64 (BlobChecksum) whenever it fills `bytes`.
struct SnapshotBlob {
  BlobDescription description;
  std::string bytes;  // a shard file's bytes
};

// The buddy shift for ranks on `hosts` (by rank): the smallest k >= 1 with
// hosts[(r + k) % W] != hosts[r] for every r, or 1 when there is none.
int BuddyShift(const std::vector<std::string>& hosts);

class SnapshotKeeper {
 public:
  SnapshotKeeper() = default;
  ~SnapshotKeeper();  // waits for the transfer in flight

  // Starts a snapshot in the background: copy `view` into a blob buffer,
  // then send the blob to rank (rank + shift) % W and receive the blob of
  // rank (rank - shift) % W of the same step over `comm`, verified.
  // REQUIRES: !in_flight(); `view`'s values unchanged until WaitCopied
  // returns; `comm` usable until Wait returns.
  // The previous transfer's error, if it failed (nothing starts then).
  absl::Status Start(ShardView view, GlooCommunicator* comm, int shift, absl::Duration timeout)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Makes the pool hold `count` buffers of at least `bytes` (counting the
  // blobs held), allocated and touched on the keeper's thread in the
  // background, so that the first snapshots neither allocate nor fault
  // pages in. in_flight() until done. The training thread calls it once per
  // generation.
  void Reserve(int64_t bytes, int count) ABSL_LOCKS_EXCLUDED(mu_);
  // Blocks until the snapshot in flight no longer reads the engine's state
  // (at once when none is in flight). The training thread calls it before
  // every optimizer step.
  void WaitCopied() ABSL_LOCKS_EXCLUDED(mu_);
  // A snapshot's copy or transfer, or Reserve, is still running.
  bool in_flight() const ABSL_LOCKS_EXCLUDED(mu_);
  // Blocks until nothing is in flight or `limit` passed; !in_flight().
  bool WaitIdle(absl::Duration limit) ABSL_LOCKS_EXCLUDED(mu_);
  // Waits for the transfer in flight; its error (the collective's, or a
  // checksum mismatch).
  absl::Status Wait();

  // The latest step for which this rank has its own blob and its buddy's
  // received copy (-1: none).
  int64_t complete_step() const ABSL_LOCKS_EXCLUDED(mu_);
  // The latest such step that is at most `limit` (-1: none).
  int64_t CompleteStepAtMost(int64_t limit) const ABSL_LOCKS_EXCLUDED(mu_);
  // Every rank agreed `step` is complete: drop blobs of older steps (their
  // buffers go back to the pool).
  void Commit(int64_t step) ABSL_LOCKS_EXCLUDED(mu_);
  int64_t committed_step() const ABSL_LOCKS_EXCLUDED(mu_);
  // A rewind to `step` (worker/worker_rewind.cc): the blobs of later steps
  // hold state the run no longer has (a loss spike's or a corrupted
  // replica's), so they are dropped and their steps no longer complete.
  // REQUIRES: no transfer in flight (Wait).
  void DropNewerThan(int64_t step) ABSL_LOCKS_EXCLUDED(mu_);

  // The blobs held, for a recovery (own and received).
  std::vector<std::shared_ptr<const SnapshotBlob>> Holdings() const ABSL_LOCKS_EXCLUDED(mu_);
  // A blob received during a recovery: kept as a holding.
  void Keep(std::shared_ptr<SnapshotBlob> blob) ABSL_LOCKS_EXCLUDED(mu_);
  // A new generation's first snapshot replaces what older generations left:
  // drops every blob whose (world_size, plan_hash) differs.
  void DropOtherPlans(int world_size, const std::string& plan_hash) ABSL_LOCKS_EXCLUDED(mu_);

  // Host bytes of every snapshot buffer (blobs held, own + buddies', and the
  // pool's), now and at the peak.
  int64_t bytes() const ABSL_LOCKS_EXCLUDED(mu_);
  int64_t peak_bytes() const ABSL_LOCKS_EXCLUDED(mu_);

  // The background thread's times for the last snapshot: the copy out of
  // the engine, and the whole (copy + checksum + swap).
  double last_copy_ms() const ABSL_LOCKS_EXCLUDED(mu_);
  double last_transfer_ms() const ABSL_LOCKS_EXCLUDED(mu_);

  // Snapshots of this rank refused since the last call for a NaN or Inf
  // value (NonFiniteTensorError's messages, oldest first): neither this
  // blob nor the buddy's copy was kept, and the step did not complete.
  std::vector<std::string> TakeRefusals() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  using Key = std::tuple<int64_t, int, int, std::string>;  // step, rank, world, plan
  static Key KeyOf(const SnapshotBlob& b) {
    const BlobDescription& d = b.description;
    return {d.step, d.rank, d.world_size, d.plan_hash};
  }
  void AddLocked(std::shared_ptr<SnapshotBlob> blob) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Drops a held blob; its buffer goes to the pool unless a Holdings() copy
  // still refers to it.
  void DropLocked(std::shared_ptr<SnapshotBlob> blob) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A buffer from the pool (the largest), or an empty one.
  std::string TakeBuffer() ABSL_LOCKS_EXCLUDED(mu_);
  // A buffer no blob keeps, back to the pool.
  void ReturnBufferLocked(std::string buffer) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void UpdateBytesLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The background half of Start.
  // Transfer's exchange with the buddies: this rank's blob `own` (its
  // header says `refused` for a shard holding NaN or Inf) to rank + shift,
  // and the blob of rank - shift kept in return, both checked.
  absl::Status ExchangeWithBuddy(std::shared_ptr<SnapshotBlob> own, bool refused,
                                 GlooCommunicator* comm, int shift, absl::Duration timeout,
                                 absl::Time start) ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status Transfer(const ShardView& view, GlooCommunicator* comm, int shift,
                        absl::Duration timeout) ABSL_LOCKS_EXCLUDED(mu_);

  mutable absl::Mutex mu_;
  std::map<Key, std::shared_ptr<SnapshotBlob>> blobs_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> pool_ ABSL_GUARDED_BY(mu_);    // free buffers
  std::map<int64_t, int> complete_ ABSL_GUARDED_BY(mu_);  // step -> 2 when own + received
  int64_t committed_ ABSL_GUARDED_BY(mu_) = -1;
  bool copying_ ABSL_GUARDED_BY(mu_) = false;    // the engine's state is being read
  bool in_flight_ ABSL_GUARDED_BY(mu_) = false;  // Start .. the transfer's end
  int64_t bytes_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t peak_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  double last_copy_ms_ ABSL_GUARDED_BY(mu_) = 0;
  double last_transfer_ms_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<std::string> refusals_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<TaskThread> thread_ = std::make_unique<TaskThread>("snapshot");
};

// A blob's checksum: the XXH64 of its size field and header, which records
// every tensor's XXH64, so it covers the data without another pass over it
// on the sender.
uint64_t BlobChecksum(const std::string& bytes);

// Parses a blob's bytes back through SafetensorsReader (the metadata and
// parameter pieces): for a blob received whole (marked received). DATA_LOSS
// naming the blob and what is wrong when `xxh64` (BlobChecksum) does not
// match, the header or its metadata is malformed, or a tensor's bytes do
// not match the XXH64 its header records.
absl::StatusOr<std::shared_ptr<SnapshotBlob>> BlobFromBytes(std::string bytes, uint64_t xxh64);

}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_RECOVERY_SNAPSHOT_KEEPER_H_
