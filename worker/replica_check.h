// Silent data corruption between HSDP replicas (--replica_check_every=N,
// docs/numerics.md). The replicas of a member's shard (ranks r with the same
// r mod G, one per shard group of G) hold bitwise-equal master shards by
// construction: their gradient shards are all-reduced to the same bits and
// their optimizer steps are the same arithmetic. Every N steps each rank
// hashes its master shard (XXH3, common/shard_hash.h) and the ranks all-gather
// the 8-byte hashes; a replica set whose hashes differ holds a shard that
// some rank's memory or arithmetic changed. The run stops
// naming the ranks and hosts, or, with a committed in-memory snapshot,
// every rank rewinds to it and re-runs (worker/worker_rewind.cc).
//
// The hash is taken by the engine right after each unit's optimizer update
// (its chunk still in the cache) and travels on the next step's verdict
// all-gather (worker/zero/step_numerics.h): no collective of its own. So a
// check after step k is judged in step k + 1, before its update.
// CheckReplicas is the standalone form, for the state after the last step.
#ifndef ZEROSHARD_WORKER_REPLICA_CHECK_H_
#define ZEROSHARD_WORKER_REPLICA_CHECK_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "worker/zero/engine.h"

namespace zeroshard {

// The line that names a mismatch after `completed` of `steps` steps: the
// ranks, their hosts (`hosts` by rank; "" when unknown) and checksums, and
// the ranks that hold a minority checksum when there is a majority. The
// caller adds what happens next (kReplicaStop, or a rewind).
inline constexpr char kReplicaStop[] =
    "; stopping: the last checkpoint or snapshot taken before the corruption holds good state";
std::string DescribeReplicaMismatch(const ReplicaMismatch& mismatch, int64_t completed,
                                    int64_t steps, const std::vector<std::string>& hosts);

// Collective (every rank): hashes this rank's master shard, all-gathers the
// hashes and compares each replica set. OK when all agree; else a numerical
// stop (FAILED_PRECONDITION, IsNonFiniteStop) naming the first mismatch. FAILED_PRECONDITION
// without shard groups (nothing to compare against: the flat stage-3 check
// against the buddy snapshot is not built).
// `hash_ms`, when not null, receives the hash's share of the time (the rest
// is the all-gather, and the wait in it for the last rank to arrive).
absl::Status CheckReplicas(ZeroEngine& engine, int64_t completed, int64_t steps,
                           const std::vector<std::string>& hosts, double* hash_ms = nullptr);

}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_REPLICA_CHECK_H_
