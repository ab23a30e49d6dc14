// In-memory snapshots, kept twice (#13): every --snapshot_every steps each
// rank copies its shard state out of the engine (the training thread's only
// pause: SnapshotShard's copy), and a background thread serializes it in the
// shard-file format (safetensors with an XXH64 per tensor, the data cursor
// in the metadata), checksums the whole blob with XXH64, and swaps copies
// with the buddies over the data plane's "snapshot" context: rank r sends
// its blob to (r + k) mod W and keeps the blob of (r - k) mod W, where k is
// the smallest shift that puts every rank's buddy on another host (1 when
// the job runs on one host).
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
#include "nlohmann/json.hpp"
#include "worker/checkpoint/shard_checkpoint.h"
#include "worker/comm/gloo_communicator.h"
#include "worker/zero/task_thread.h"

namespace zeroshard {

// Rows [row_begin, row_end) of a model tensor.
struct RowRange {
  std::string tensor;
  int64_t row_begin = 0;
  int64_t row_end = 0;
};

// One rank's shard state at a step.
struct SnapshotBlob {
  int64_t step = 0;
  int rank = 0;  // in the generation that saved it
  int world_size = 0;
  std::string plan_hash;
  int64_t data_row = 0;
  std::string bytes;             // a shard file's bytes
  uint64_t xxh64 = 0;            // of `bytes`
  std::vector<RowRange> pieces;  // the parameter pieces it holds

  // Everything but the bytes, for the recovery's agreement.
  nlohmann::json Describe() const;
};

// The buddy shift for ranks on `hosts` (by rank): the smallest k >= 1 with
// hosts[(r + k) % W] != hosts[r] for every r, or 1 when there is none.
int BuddyShift(const std::vector<std::string>& hosts);

class SnapshotKeeper {
 public:
  SnapshotKeeper() = default;
  ~SnapshotKeeper();  // waits for the transfer in flight

  // Starts the background half of a snapshot: serialize `snapshot` (with
  // `data_row`), then send it to rank (rank + shift) % W and receive the
  // blob of rank (rank - shift) % W of the same step over `comm`, verified.
  // REQUIRES: no transfer in flight (Wait first); `comm` stays usable until
  // Wait returns.
  void Start(ShardSnapshot snapshot, GlooCommunicator* comm, int shift, absl::Duration timeout);
  // Waits for the transfer in flight; its error (the collective's, or a
  // checksum mismatch).
  absl::Status Wait();

  // The latest step for which this rank has its own blob and its buddy's
  // received copy (-1: none).
  int64_t complete_step() const ABSL_LOCKS_EXCLUDED(mu_);
  // Every rank agreed `step` is complete: drop blobs of older steps.
  void Commit(int64_t step) ABSL_LOCKS_EXCLUDED(mu_);
  int64_t committed_step() const ABSL_LOCKS_EXCLUDED(mu_);

  // The blobs held, for a recovery (own and received).
  std::vector<std::shared_ptr<const SnapshotBlob>> Holdings() const ABSL_LOCKS_EXCLUDED(mu_);
  // A blob received during a recovery: kept as a holding.
  void Keep(std::shared_ptr<const SnapshotBlob> blob) ABSL_LOCKS_EXCLUDED(mu_);
  // A new generation's first snapshot replaces what older generations left:
  // drops every blob whose (world_size, plan_hash) differs.
  void DropOtherPlans(int world_size, const std::string& plan_hash) ABSL_LOCKS_EXCLUDED(mu_);

  // Host bytes of every blob held (own + buddies'), now and at the peak.
  int64_t bytes() const ABSL_LOCKS_EXCLUDED(mu_);
  int64_t peak_bytes() const ABSL_LOCKS_EXCLUDED(mu_);

  // The background thread's time for the last transfer (serialize + swap).
  double last_transfer_ms() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  using Key = std::tuple<int64_t, int, int, std::string>;  // step, rank, world, plan
  static Key KeyOf(const SnapshotBlob& b) { return {b.step, b.rank, b.world_size, b.plan_hash}; }
  void AddLocked(std::shared_ptr<const SnapshotBlob> blob) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  std::map<Key, std::shared_ptr<const SnapshotBlob>> blobs_ ABSL_GUARDED_BY(mu_);
  std::map<int64_t, int> complete_ ABSL_GUARDED_BY(mu_);  // step -> 2 when own + received
  int64_t committed_ ABSL_GUARDED_BY(mu_) = -1;
  int64_t bytes_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t peak_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  double last_transfer_ms_ ABSL_GUARDED_BY(mu_) = 0;
  std::unique_ptr<TaskThread> thread_ = std::make_unique<TaskThread>("snapshot");
};

// Parses a blob's bytes back (the metadata and parameter pieces): for a
// blob received whole. DATA_LOSS when `xxh64` does not match.
absl::StatusOr<std::shared_ptr<SnapshotBlob>> BlobFromBytes(std::string bytes, uint64_t xxh64);

}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_RECOVERY_SNAPSHOT_KEEPER_H_
