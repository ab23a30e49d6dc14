// Silent data corruption between HSDP replicas (--replica_check_every=N,
// docs/numerics.md). The replicas of a member's shard (ranks r with the same
// r mod G, one per shard group of G) hold bitwise-equal master shards by
// construction: their gradient shards are all-reduced to the same bits and
// their optimizer steps are the same arithmetic. Every N steps each rank
// hashes its master shard (XXH64, at memory speed) and the ranks all-gather
// the 8-byte hashes; a replica set whose hashes differ holds a shard that
// some rank's memory or arithmetic changed. Detection only: the run stops
// naming the ranks and hosts (no rewind yet).
#ifndef ZEROSHARD_WORKER_REPLICA_CHECK_H_
#define ZEROSHARD_WORKER_REPLICA_CHECK_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "worker/zero/engine.h"

namespace zeroshard {

// A replica set whose shards differ: the member (r mod G) and its ranks
// with their checksums, in rank order.
struct ReplicaMismatch {
  int member = 0;
  std::vector<int> ranks;
  std::vector<uint64_t> checksums;
};

// The replica sets of `checksums` (by rank, W = size) under groups of
// `group_size` ranks whose checksums are not all equal. Pure.
std::vector<ReplicaMismatch> FindReplicaMismatches(const std::vector<uint64_t>& checksums,
                                                   int group_size);

// The line that names a mismatch after `completed` of `steps` steps: the
// ranks, their hosts (`hosts` by rank; "" when unknown) and checksums, and
// the ranks that hold a minority checksum when there is a majority.
std::string DescribeReplicaMismatch(const ReplicaMismatch& mismatch, int64_t completed,
                                    int64_t steps, const std::vector<std::string>& hosts);

// Collective (every rank): hashes this rank's master shard, all-gathers the
// hashes and compares each replica set. OK when all agree; else a numerical
// stop (FAILED_PRECONDITION, IsNonFiniteStop) naming the first mismatch. FAILED_PRECONDITION
// without shard groups (nothing to compare against: the flat stage-3 check
// against the buddy snapshot is not built).
absl::Status CheckReplicas(ZeroEngine& engine, int64_t completed, int64_t steps,
                           const std::vector<std::string>& hosts);

}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_REPLICA_CHECK_H_
