#include "worker/recovery/snapshot_restore.h"

#include <cassert>
#include <map>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/checkpoint_format.h"

namespace zeroshard {
namespace {

using BlobsByOldRank = std::map<int, std::shared_ptr<const SnapshotBlob>>;

// What `keeper` holds of the decided snapshot step, by old rank.
BlobsByOldRank HeldBlobsOf(const SnapshotKeeper& keeper, const RecoveryDecision& d) {
  BlobsByOldRank have;
  for (const auto& blob : keeper.Holdings()) {
    const BlobDescription& held = blob->description;
    if (held.step == d.step && held.world_size == d.old_world_size &&
        held.plan_hash == d.plan_hash) {
      have[held.rank] = blob;
    }
  }
  return have;
}

// Runs this rank's share of the transfers; the received bytes by old rank.
absl::StatusOr<std::map<int, std::string>> MoveBlobs(const RecoveryDecision& d, int rank,
                                                     const BlobsByOldRank& have,
                                                     GlooCommunicator* comm,
                                                     absl::Duration timeout) {
  std::vector<GlooCommunicator::PointToPoint> sends, recvs;
  std::map<int, std::string> received;
  for (const SnapshotTransfer& t : d.transfers) {
    const uint32_t tag = static_cast<uint32_t>(t.old_rank);
    if (t.from == rank) {
      auto it = have.find(t.old_rank);
      if (it == have.end()) {
        return absl::InternalError(absl::StrCat("asked to send the snapshot of old rank ",
                                                t.old_rank, " (step ", d.step, "), not held here"));
      }
      sends.push_back({t.to, tag, const_cast<char*>(it->second->bytes.data()),
                       static_cast<int64_t>(it->second->bytes.size())});
    }
    if (t.to == rank) {
      const int64_t bytes = d.blobs.at(t.old_rank).bytes;
      received[t.old_rank].assign(bytes, '\0');
      recvs.push_back({t.from, tag, received[t.old_rank].data(), bytes});
    }
  }
  if (sends.empty() && recvs.empty()) return received;
  if (comm == nullptr) {
    return absl::FailedPreconditionError(
        "snapshot transfers need the snapshot context (--snapshot_every > 0 on every rank)");
  }
  if (absl::Status s = comm->SendRecv(sends, recvs, timeout); !s.ok()) return s;
  return received;
}

// Verifies the received blobs and keeps them (in `keeper` and `have`).
absl::Status KeepReceived(const RecoveryDecision& d, std::map<int, std::string> received,
                          SnapshotKeeper* keeper, BlobsByOldRank* have) {
  for (auto& [old_rank, bytes] : received) {
    absl::StatusOr<std::shared_ptr<SnapshotBlob>> blob =
        BlobFromBytes(std::move(bytes), d.blobs.at(old_rank).xxh64);
    if (!blob.ok()) {
      return absl::Status(blob.status().code(), absl::StrCat("snapshot of old rank ", old_rank,
                                                             ": ", blob.status().message()));
    }
    keeper->Keep(*blob);
    (*have)[old_rank] = *blob;
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<SnapshotPieces> GatherSnapshotPieces(const RecoveryDecision& d, int rank,
                                                    SnapshotKeeper* keeper, GlooCommunicator* comm,
                                                    absl::Duration timeout) {
  assert(d.source == RecoverySource::kSnapshot);
  assert(rank >= 0 && rank < static_cast<int>(d.needs.size()));
  BlobsByOldRank have = HeldBlobsOf(*keeper, d);
  const absl::Time start = absl::Now();
  absl::StatusOr<std::map<int, std::string>> received = MoveBlobs(d, rank, have, comm, timeout);
  if (!received.ok()) return received.status();
  SnapshotPieces pieces;
  pieces.received = static_cast<int>(received->size());
  if (absl::Status s = KeepReceived(d, *std::move(received), keeper, &have); !s.ok()) return s;
  pieces.moved_ms = absl::ToDoubleMilliseconds(absl::Now() - start);
  // The old pieces this rank needs, its own old rank's blob first. Every
  // tensor's XXH64 was checked already: as the blob was made
  // (SerializeShardInto) or on receipt (BlobFromBytes).
  std::vector<CheckpointReader::MemoryFile> files;
  for (int old_rank : d.needs[rank]) {
    auto it = have.find(old_rank);
    if (it == have.end()) {
      return absl::InternalError(absl::StrCat("the snapshot of old rank ", old_rank, " (step ",
                                              d.step, ") did not arrive"));
    }
    pieces.blobs.push_back(it->second);
    files.push_back({CheckpointShardFileName(old_rank, d.old_world_size), it->second->bytes});
    if (old_rank == rank) std::swap(files.front(), files.back());
  }
  if (files.empty()) return pieces;  // a rank with no piece
  absl::StatusOr<std::unique_ptr<CheckpointReader>> reader = CheckpointReader::OpenMemory(
      absl::StrCat("snapshot of step ", d.step, " at world size ", d.old_world_size),
      std::move(files), /*verified=*/true);
  if (!reader.ok()) return reader.status();
  pieces.reader = *std::move(reader);
  return pieces;
}

}  // namespace zeroshard
