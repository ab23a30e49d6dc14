// The kSnapshot tier of a recovery (#13) on one rank: the blobs the decision
// moves between ranks travel over the data plane's snapshot context, are
// verified and kept, and the old pieces this rank's new plan needs are opened
// as one checkpoint step held in memory (the arithmetic of resharding a
// checkpoint).
#ifndef ZEROSHARD_WORKER_RECOVERY_SNAPSHOT_RESTORE_H_
#define ZEROSHARD_WORKER_RECOVERY_SNAPSHOT_RESTORE_H_

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "worker/checkpoint/shard_checkpoint.h"
#include "worker/comm/gloo_communicator.h"
#include "worker/recovery/recovery_decision.h"
#include "worker/recovery/snapshot_keeper.h"

namespace zeroshard {

struct SnapshotPieces {
  // The blobs the reader reads from: they must outlive it.
  std::vector<std::shared_ptr<const SnapshotBlob>> blobs;
  // Null when this rank has no piece in the new plan.
  std::unique_ptr<CheckpointReader> reader;
  int received = 0;     // blobs received from other ranks
  double moved_ms = 0;  // the transfers' wall time
};

// Runs `decision`'s transfers that involve `rank` over `comm` (null when the
// data plane has no snapshot context: FAILED_PRECONDITION if a transfer is
// needed), keeps what arrives in `keeper`, and opens this rank's needs.
// DATA_LOSS when a received blob fails its checksum.
// REQUIRES: decision.source == RecoverySource::kSnapshot.
absl::StatusOr<SnapshotPieces> GatherSnapshotPieces(const RecoveryDecision& decision, int rank,
                                                    SnapshotKeeper* keeper, GlooCommunicator* comm,
                                                    absl::Duration timeout);

}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_RECOVERY_SNAPSHOT_RESTORE_H_
