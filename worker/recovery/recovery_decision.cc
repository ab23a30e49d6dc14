#include "worker/recovery/recovery_decision.h"

#include <algorithm>
#include <cassert>
#include <optional>
#include <set>
#include <tuple>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/checksum.h"
#include "common/plan/shard_groups.h"
#include "nlohmann/json.hpp"

namespace zeroshard {
namespace {

// A snapshot step as one generation saved it: (step, world size, plan hash).
using SnapshotKey = std::tuple<int64_t, int, std::string>;

// One old rank's blob of a snapshot step, and the new ranks holding it.
struct HeldBlob {
  const BlobDescription* blob = nullptr;
  std::vector<int> holders;    // new ranks, ascending
  std::vector<bool> received;  // by holder: its copy was received, not saved
};
using HeldByOldRank = std::map<int, HeldBlob>;

std::map<SnapshotKey, HeldByOldRank> GroupBlobsBySnapshot(
    const std::vector<RankHoldings>& holdings) {
  std::map<SnapshotKey, HeldByOldRank> groups;
  for (int r = 0; r < static_cast<int>(holdings.size()); ++r) {
    for (const BlobDescription& b : holdings[r].blobs) {
      HeldBlob& held = groups[{b.step, b.world_size, b.plan_hash}][b.rank];
      held.blob = &b;
      held.holders.push_back(r);
      held.received.push_back(b.received);
    }
  }
  return groups;
}

// Rows of model tensors not yet covered: per tensor, disjoint [begin, end)
// runs.
class UncoveredRows {
 public:
  void Add(const std::string& tensor, int64_t begin, int64_t end) {
    if (begin < end) runs_[tensor].push_back({begin, end});
  }
  // Removes `rows`; whether anything was removed.
  bool Remove(const RowRange& rows) {
    auto it = runs_.find(rows.tensor);
    if (it == runs_.end()) return false;
    std::vector<std::pair<int64_t, int64_t>> left;
    bool removed = false;
    for (const auto& [b, e] : it->second) {
      if (rows.row_end <= b || e <= rows.row_begin) {
        left.push_back({b, e});
        continue;
      }
      removed = true;
      if (b < rows.row_begin) left.push_back({b, rows.row_begin});
      if (rows.row_end < e) left.push_back({rows.row_end, e});
    }
    if (left.empty()) {
      runs_.erase(it);
    } else {
      it->second = std::move(left);
    }
    return removed;
  }
  bool Overlaps(const RowRange& rows) const {
    auto it = runs_.find(rows.tensor);
    if (it == runs_.end()) return false;
    for (const auto& [b, e] : it->second) {
      if (rows.row_begin < e && b < rows.row_end) return true;
    }
    return false;
  }
  bool empty() const { return runs_.empty(); }

 private:
  std::map<std::string, std::vector<std::pair<int64_t, int64_t>>> runs_;
};

// The rows new rank `rank` loads: its pieces of `plan`, and with shard
// groups of G (planner.h) every replica's (k G + rank % G), its member's
// whole shard; with `every_row` (replicated parameters) every piece's.
UncoveredRows RowsRankNeeds(const ShardPlan& plan, int rank, int world, bool every_row) {
  UncoveredRows rows;
  const ShardGroups groups = plan.options.Groups(world);
  for (const ShardUnit& unit : plan.units) {
    for (const Piece& p : unit.pieces) {
      assert(p.rank >= 0 && p.rank < world);
      if (every_row || groups.SameShard(p.rank, rank)) {
        rows.Add(unit.tensors[p.tensor].name, p.row_begin, p.row_end);
      }
    }
  }
  return rows;
}

bool BlobOverlaps(const BlobDescription& blob, const UncoveredRows& rows) {
  for (const RowRange& r : blob.pieces) {
    if (rows.Overlaps(r)) return true;
  }
  return false;
}

// How far old rank `old_rank`'s blob is from new rank `rank`: 0 held there,
// 1 held by a rank on its host, 2 elsewhere.
int Distance(const HeldBlob& held, int rank, const std::vector<RankHoldings>& holdings) {
  int best = 2;
  for (int h : held.holders) {
    if (h == rank) return 0;
    if (!holdings[rank].host.empty() && holdings[h].host == holdings[rank].host) best = 1;
  }
  return best;
}

// The old ranks whose blobs new rank `rank` reads its rows from: greedily,
// nearest first (its own old rank's blob first among equals, then rotated by
// rank so that ranks spread over the holders), each taken only if it covers
// rows not covered yet. False when the held blobs leave a row uncovered.
bool CoverRank(const ShardPlan& plan, int rank, const HeldByOldRank& held, int old_world,
               const std::vector<RankHoldings>& holdings, bool every_row, std::set<int>* cover) {
  const int world = static_cast<int>(holdings.size());
  UncoveredRows rows = RowsRankNeeds(plan, rank, world, every_row);
  std::vector<std::tuple<int, int, int>> order;  // (distance, rotation, old rank)
  for (const auto& [o, h] : held) {
    if (!BlobOverlaps(*h.blob, rows)) continue;
    order.push_back(
        {Distance(h, rank, holdings), ((o - rank) % old_world + old_world) % old_world, o});
  }
  std::sort(order.begin(), order.end());
  for (const auto& [distance, rotation, o] : order) {
    bool covers = false;
    for (const RowRange& r : held.at(o).blob->pieces) covers = rows.Remove(r) || covers;
    if (covers) cover->insert(o);
    if (rows.empty()) break;
  }
  return rows.empty();
}

// By new rank, the blobs it reads from; empty when the snapshot step does not
// cover the model. With an empty plan (no rows to cover) a blob of every old
// rank must be held, and every rank needs none.
std::optional<std::vector<std::set<int>>> CoverEveryRank(const ShardPlan& plan,
                                                         const SnapshotKey& key,
                                                         const HeldByOldRank& held,
                                                         const std::vector<RankHoldings>& holdings,
                                                         bool every_row) {
  const int old_world = std::get<1>(key);
  if (plan.units.empty() && static_cast<int>(held.size()) != old_world) return std::nullopt;
  std::vector<std::set<int>> covers(holdings.size());
  for (int r = 0; r < static_cast<int>(holdings.size()); ++r) {
    if (!CoverRank(plan, r, held, old_world, holdings, every_row, &covers[r])) {
      return std::nullopt;
    }
  }
  return covers;
}

TransferKind KindOf(const HeldBlob& held, size_t holder, int to, const ShardPlan& plan, int world) {
  if (held.received[holder]) return TransferKind::kBuddy;
  const ShardGroups groups = plan.options.Groups(world);
  return groups.hybrid() && groups.SameShard(held.holders[holder], to) ? TransferKind::kReplica
                                                                       : TransferKind::kPeer;
}

// A blob a rank needs and does not hold comes from one of its holders: one
// on the rank's host if there is one, its own saver rather than a received
// copy, spread over the candidates by (rank + old rank).
std::vector<SnapshotTransfer> TransfersFor(const std::vector<std::set<int>>& needs,
                                           const HeldByOldRank& held, const ShardPlan& plan,
                                           const std::vector<RankHoldings>& holdings) {
  const int world = static_cast<int>(needs.size());
  std::vector<SnapshotTransfer> transfers;
  for (int r = 0; r < world; ++r) {
    for (int o : needs[r]) {
      const HeldBlob& h = held.at(o);
      if (std::find(h.holders.begin(), h.holders.end(), r) != h.holders.end()) continue;
      std::vector<std::tuple<int, bool, size_t>> ranked;  // (same host? 0 : 1, received, index)
      for (size_t i = 0; i < h.holders.size(); ++i) {
        const bool near =
            !holdings[r].host.empty() && holdings[h.holders[i]].host == holdings[r].host;
        ranked.push_back({near ? 0 : 1, h.received[i], i});
      }
      std::sort(ranked.begin(), ranked.end());
      size_t best = 0;
      while (best < ranked.size() && std::get<0>(ranked[best]) == std::get<0>(ranked[0]) &&
             std::get<1>(ranked[best]) == std::get<1>(ranked[0])) {
        ++best;
      }
      const size_t pick = std::get<2>(ranked[(r + o) % best]);
      transfers.push_back({h.holders[pick], r, o, KindOf(h, pick, r, plan, world)});
    }
  }
  return transfers;
}

RecoveryDecision SnapshotDecision(const SnapshotKey& key, const HeldByOldRank& held,
                                  const std::vector<std::set<int>>& needs, const ShardPlan& plan,
                                  const std::vector<RankHoldings>& holdings) {
  RecoveryDecision d;
  d.source = RecoverySource::kSnapshot;
  std::tie(d.step, d.old_world_size, d.plan_hash) = key;
  d.transfers = TransfersFor(needs, held, plan, holdings);
  for (const std::set<int>& n : needs) d.needs.emplace_back(n.begin(), n.end());
  for (const auto& [old_rank, h] : held) d.blobs[old_rank] = {h.blob->bytes, h.blob->xxh64};
  int replica = 0;
  for (const SnapshotTransfer& t : d.transfers) replica += t.kind == TransferKind::kReplica;
  d.why = absl::StrCat("in-memory snapshot covering every row, from blobs of ", held.size(), " of ",
                       d.old_world_size, " old ranks; ", d.transfers.size(), " transfers (",
                       replica, " from a replica)");
  return d;
}

}  // namespace

bool AnyRankHasState(const std::vector<RankHoldings>& holdings) {
  for (const RankHoldings& h : holdings) {
    if (h.survivor || !h.blobs.empty()) return true;
  }
  return false;
}

absl::string_view TransferKindName(TransferKind kind) {
  switch (kind) {
    case TransferKind::kReplica:
      return "replica";
    case TransferKind::kBuddy:
      return "buddy";
    case TransferKind::kPeer:
      return "peer";
  }
  return "unknown";
}

absl::string_view RecoverySourceName(RecoverySource source) {
  switch (source) {
    case RecoverySource::kInitial:
      return "initial";
    case RecoverySource::kSnapshot:
      return "snapshot";
    case RecoverySource::kDisk:
      return "disk";
    case RecoverySource::kScratch:
      return "scratch";
  }
  return "unknown";
}

RecoveryDecision DecideSource(const std::vector<RankHoldings>& holdings, const ShardPlan& plan,
                              int64_t disk_step, bool every_row) {
  const int world = static_cast<int>(holdings.size());
  assert(plan.units.empty() || plan.world_size == world);
  RecoveryDecision d;
  if (!AnyRankHasState(holdings)) return d;  // kInitial
  const std::map<SnapshotKey, HeldByOldRank> groups = GroupBlobsBySnapshot(holdings);
  // The latest complete step; among equal steps the first in key order.
  const SnapshotKey* best = nullptr;
  std::vector<std::set<int>> best_needs;
  for (const auto& [key, held] : groups) {
    if (best != nullptr && std::get<0>(key) <= std::get<0>(*best)) continue;
    std::optional<std::vector<std::set<int>>> needs =
        CoverEveryRank(plan, key, held, holdings, every_row);
    if (!needs.has_value()) continue;
    best = &key;
    best_needs = *std::move(needs);
  }
  if (best != nullptr && std::get<0>(*best) >= disk_step) {
    return SnapshotDecision(*best, groups.at(*best), best_needs, plan, holdings);
  }
  if (disk_step >= 0) {
    d.source = RecoverySource::kDisk;
    d.step = disk_step;
    d.why = best == nullptr ? "no in-memory snapshot step covers every row (a rank and its "
                              "buddy, or every replica of a shard, lost?)"
                            : "the disk checkpoint is newer than the snapshots";
    return d;
  }
  d.source = RecoverySource::kScratch;
  d.step = 0;
  d.why =
      "neither an in-memory snapshot covering every row nor a complete disk checkpoint "
      "exists: starting again from the seed";
  return d;
}

// ---- The KV edge ----

namespace {

using nlohmann::json;

// Parses `text` and runs `read` over it; a malformed text or a field of the
// wrong type becomes INVALID_ARGUMENT naming `what`.
template <typename T, typename Read>
absl::StatusOr<T> ParseGuarded(absl::string_view text, absl::string_view what, Read read) {
  const json j = json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": not a JSON object: ", text.substr(0, 80)));
  }
  try {
    return read(j);
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": ", e.what()));
  }
}

absl::StatusOr<uint64_t> ChecksumField(const json& j) {
  return ParseChecksumHex(j.get<std::string>());
}

json BlobToJson(const BlobDescription& b) {
  json pieces = json::array();
  for (const RowRange& p : b.pieces) pieces.push_back({p.tensor, p.row_begin, p.row_end});
  return {{"step", b.step},
          {"rank", b.rank},
          {"world_size", b.world_size},
          {"plan_hash", b.plan_hash},
          {"data_row", b.data_row},
          {"bytes", b.bytes},
          {"xxh64", ChecksumToHex(b.xxh64)},
          {"pieces", pieces},
          {"received", b.received}};
}

absl::StatusOr<BlobDescription> BlobFromJson(const json& j) {
  BlobDescription b;
  b.step = j.at("step").get<int64_t>();
  b.rank = j.at("rank").get<int>();
  b.world_size = j.at("world_size").get<int>();
  b.plan_hash = j.at("plan_hash").get<std::string>();
  b.data_row = j.at("data_row").get<int64_t>();
  b.bytes = j.at("bytes").get<int64_t>();
  absl::StatusOr<uint64_t> sum = ChecksumField(j.at("xxh64"));
  if (!sum.ok()) return sum.status();
  b.xxh64 = *sum;
  b.received = j.value("received", false);
  for (const json& p : j.at("pieces")) {
    b.pieces.push_back(
        {p.at(0).get<std::string>(), p.at(1).get<int64_t>(), p.at(2).get<int64_t>()});
  }
  return b;
}

absl::StatusOr<RecoverySource> SourceFromName(absl::string_view name) {
  for (RecoverySource s : {RecoverySource::kInitial, RecoverySource::kSnapshot,
                           RecoverySource::kDisk, RecoverySource::kScratch}) {
    if (RecoverySourceName(s) == name) return s;
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown recovery source '", name, "'"));
}

absl::StatusOr<TransferKind> TransferKindFromName(absl::string_view name) {
  for (TransferKind k : {TransferKind::kReplica, TransferKind::kBuddy, TransferKind::kPeer}) {
    if (TransferKindName(k) == name) return k;
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown snapshot transfer kind '", name, "'"));
}

}  // namespace

std::string RankHoldingsToJson(const RankHoldings& holdings) {
  json blobs = json::array();
  for (const BlobDescription& b : holdings.blobs) blobs.push_back(BlobToJson(b));
  return json({{"survivor", holdings.survivor}, {"blobs", blobs}, {"host", holdings.host}}).dump();
}

absl::StatusOr<RankHoldings> RankHoldingsFromJson(absl::string_view text) {
  return ParseGuarded<RankHoldings>(text, "recovery holdings",
                                    [](const json& j) -> absl::StatusOr<RankHoldings> {
                                      RankHoldings h;
                                      h.survivor = j.at("survivor").get<bool>();
                                      h.host = j.value("host", std::string());
                                      for (const json& b : j.at("blobs")) {
                                        absl::StatusOr<BlobDescription> blob = BlobFromJson(b);
                                        if (!blob.ok()) return blob.status();
                                        h.blobs.push_back(*std::move(blob));
                                      }
                                      return h;
                                    });
}

std::string RecoveryDecisionToJson(const RecoveryDecision& d) {
  json j = {{"source", std::string(RecoverySourceName(d.source))}};
  if (d.source == RecoverySource::kInitial) return j.dump();
  j["step"] = d.step;
  j["why"] = d.why;
  if (d.source != RecoverySource::kSnapshot) return j.dump();
  j["world_size"] = d.old_world_size;
  j["plan_hash"] = d.plan_hash;
  json transfers = json::array();
  for (const SnapshotTransfer& t : d.transfers) {
    transfers.push_back({t.from, t.to, t.old_rank, std::string(TransferKindName(t.kind))});
  }
  j["transfers"] = transfers;
  j["needs"] = d.needs;
  json blobs = json::object();
  for (const auto& [old_rank, size] : d.blobs) {
    blobs[absl::StrCat(old_rank)] = {size.bytes, ChecksumToHex(size.xxh64)};
  }
  j["blobs"] = blobs;
  return j.dump();
}

absl::StatusOr<RecoveryDecision> RecoveryDecisionFromJson(absl::string_view text) {
  return ParseGuarded<RecoveryDecision>(
      text, "recovery decision", [](const json& j) -> absl::StatusOr<RecoveryDecision> {
        RecoveryDecision d;
        absl::StatusOr<RecoverySource> source = SourceFromName(j.at("source").get<std::string>());
        if (!source.ok()) return source.status();
        d.source = *source;
        if (d.source == RecoverySource::kInitial) return d;
        d.step = j.at("step").get<int64_t>();
        d.why = j.value("why", std::string());
        if (d.source != RecoverySource::kSnapshot) return d;
        d.old_world_size = j.at("world_size").get<int>();
        d.plan_hash = j.at("plan_hash").get<std::string>();
        for (const json& t : j.at("transfers")) {
          absl::StatusOr<TransferKind> kind = TransferKindFromName(t.at(3).get<std::string>());
          if (!kind.ok()) return kind.status();
          d.transfers.push_back(
              {t.at(0).get<int>(), t.at(1).get<int>(), t.at(2).get<int>(), *kind});
        }
        d.needs = j.at("needs").get<std::vector<std::vector<int>>>();
        for (const auto& [key, size] : j.at("blobs").items()) {
          int old_rank = 0;
          if (!absl::SimpleAtoi(key, &old_rank)) {
            return absl::InvalidArgumentError(
                absl::StrCat("recovery decision: blob key '", key, "' is not a rank"));
          }
          absl::StatusOr<uint64_t> sum = ChecksumField(size.at(1));
          if (!sum.ok()) return sum.status();
          d.blobs[old_rank] = {size.at(0).get<int64_t>(), *sum};
        }
        return d;
      });
}

}  // namespace zeroshard
