// Where a new job generation's state comes from (#13), decided once by rank 0
// from what every rank holds, and read by every rank. See docs/recovery.md.
//
// The tiers, cheapest first:
//   kSnapshot  the latest step whose in-memory blobs, together, cover every
//              row of the model (survivors' own blobs, the buddies' copies,
//              and in HSDP the replicas' blobs, which hold their replica
//              peer's rows too: SnapshotSchedule); each rank picks a cover of
//              its new plan's rows among the blobs (its own first, then
//              blobs held on its host, then any holder, spread), the blobs
//              it lacks move over the data plane, and it reads its rows from
//              the old pieces;
//   kDisk      the latest complete disk checkpoint, when it is newer than every
//              complete snapshot step, or when no snapshot step is complete (a
//              rank and its buddy were both lost);
//   kScratch   the seed at step 0, when there is state but neither tier has it;
//   kInitial   nobody has state: a fresh job (--resume, --init_from, the seed).
//
// DecideSource is pure: it sees only typed values. JSON appears only where the
// values cross the job's KV store (the *Json functions at the bottom).
#ifndef ZEROSHARD_WORKER_RECOVERY_RECOVERY_DECISION_H_
#define ZEROSHARD_WORKER_RECOVERY_RECOVERY_DECISION_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/plan/shard_plan.h"

namespace zeroshard {

enum class RecoverySource { kInitial, kSnapshot, kDisk, kScratch };

// "initial", "snapshot", "disk", "scratch": the words logs and the
// RecoveryRecord use.
absl::string_view RecoverySourceName(RecoverySource source);

// Rows [row_begin, row_end) of a model tensor.
struct RowRange {
  std::string tensor;
  int64_t row_begin = 0;
  int64_t row_end = 0;
};

// One snapshot blob as a rank describes it to the others: everything but its
// bytes.
struct BlobDescription {
  int64_t step = 0;
  int rank = 0;  // in the generation that saved it
  int world_size = 0;
  std::string plan_hash;
  int64_t data_row = 0;
  int64_t bytes = 0;             // the blob's size
  uint64_t xxh64 = 0;            // BlobChecksum of the blob
  std::vector<RowRange> pieces;  // the parameter pieces it holds
  // The holder received it (a buddy's copy, or moved in a recovery) rather
  // than saved it.
  bool received = false;
};

// What one rank of the new generation brings to the agreement.
struct RankHoldings {
  bool survivor = false;  // it completed a step in some earlier generation
  std::vector<BlobDescription> blobs;
  std::string host;  // where it runs ("": unknown); a source on the same host is preferred
};

// Where a transferred blob comes from, for logs and the run report:
//   kReplica  the sender saved it and is a replica of the receiver in the new
//             plan's shard groups (HSDP: it holds the same shard);
//   kBuddy    the sender holds a received copy (the buddy snapshot);
//   kPeer     the sender saved it, not a replica (resharding after a shrink).
enum class TransferKind { kReplica, kBuddy, kPeer };
absl::string_view TransferKindName(TransferKind kind);  // "replica", "buddy", "peer"

// Old rank `old_rank`'s blob goes from new rank `from` to new rank `to`.
struct SnapshotTransfer {
  int from = 0;
  int to = 0;
  int old_rank = 0;
  TransferKind kind = TransferKind::kPeer;
};

struct BlobSize {
  int64_t bytes = 0;
  uint64_t xxh64 = 0;
};

struct RecoveryDecision {
  RecoverySource source = RecoverySource::kInitial;
  int64_t step = 0;  // the step training resumes at (kInitial: unused)
  std::string why;   // one line for the log

  // kSnapshot only.
  int old_world_size = 0;
  std::string plan_hash;  // the old plan's
  std::vector<SnapshotTransfer> transfers;
  // By new rank: the old ranks whose blobs it reads its new pieces from: a
  // cover of its rows (ascending).
  std::vector<std::vector<int>> needs;
  std::map<int, BlobSize> blobs;  // by old rank
};

// Some rank trained before or holds a blob: this generation recovers.
bool AnyRankHasState(const std::vector<RankHoldings>& holdings);

// The decision for a generation whose ranks hold `holdings` (indexed by new
// rank), with the new `plan`, and `disk_step` the latest complete disk
// checkpoint (-1: none). A snapshot step is complete when its blobs held
// cover every row of every tensor in `plan` (with an empty plan: when a blob
// of every old rank is held). Deterministic: among complete snapshot steps the
// latest wins, ties going to the smaller old world size, then plan hash.
// REQUIRES: plan.world_size == holdings.size() (or an empty plan).
// `every_row`: each rank loads every parameter row (stages 0-2 replicate the
// parameters), not only its shard's.
RecoveryDecision DecideSource(const std::vector<RankHoldings>& holdings, const ShardPlan& plan,
                              int64_t disk_step, bool every_row = false);

// ---- The KV edge ----
// The JSON forms are spoken only between workers of one build. The parsers
// return INVALID_ARGUMENT naming the field for text that is not the form.
std::string RankHoldingsToJson(const RankHoldings& holdings);
absl::StatusOr<RankHoldings> RankHoldingsFromJson(absl::string_view text);
std::string RecoveryDecisionToJson(const RecoveryDecision& decision);
absl::StatusOr<RecoveryDecision> RecoveryDecisionFromJson(absl::string_view text);

}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_RECOVERY_RECOVERY_DECISION_H_
