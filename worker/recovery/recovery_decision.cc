#include "worker/recovery/recovery_decision.h"

#include <algorithm>
#include <cassert>
#include <set>
#include <tuple>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/checksum.h"
#include "nlohmann/json.hpp"

namespace zeroshard {
namespace {

// A snapshot step as one generation saved it: (step, world size, plan hash).
using SnapshotKey = std::tuple<int64_t, int, std::string>;

// One old rank's blob of a snapshot step, and the new ranks holding it.
struct HeldBlob {
  const BlobDescription* blob = nullptr;
  std::vector<int> holders;  // new ranks, ascending
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
    }
  }
  return groups;
}

// The latest snapshot step held for every one of its old ranks; null: none.
const std::pair<const SnapshotKey, HeldByOldRank>* LatestCompleteSnapshot(
    const std::map<SnapshotKey, HeldByOldRank>& groups) {
  const std::pair<const SnapshotKey, HeldByOldRank>* best = nullptr;
  for (const auto& group : groups) {
    const auto& [key, held] = group;
    if (static_cast<int>(held.size()) != std::get<1>(key)) continue;
    if (best == nullptr || std::get<0>(key) > std::get<0>(best->first)) best = &group;
  }
  return best;
}

bool Overlap(const Piece& p, const std::string& name, const RowRange& old) {
  return old.tensor == name && old.row_begin < p.row_end && p.row_begin < old.row_end;
}

// By new rank: the old ranks whose pieces overlap its pieces of `plan`. With
// shard groups of G (planner.h) a rank computes on its member's whole shard,
// so a piece of rank r is needed by every replica of it (k G + r % G).
std::vector<std::set<int>> OldRanksEachRankNeeds(const ShardPlan& plan, const HeldByOldRank& held,
                                                 int world) {
  std::vector<std::set<int>> needs(world);
  const int group = plan.options.ShardGroupSize(world);
  for (const ShardUnit& unit : plan.units) {
    for (const Piece& p : unit.pieces) {
      assert(p.rank >= 0 && p.rank < world);
      const std::string& name = unit.tensors[p.tensor].name;
      for (const auto& [old_rank, h] : held) {
        for (const RowRange& old : h.blob->pieces) {
          if (!Overlap(p, name, old)) continue;
          for (int r = p.rank % group; r < world; r += group) needs[r].insert(old_rank);
        }
      }
    }
  }
  return needs;
}

// A blob a rank needs and does not hold comes from one of its holders,
// spread over them by (rank + old rank).
std::vector<SnapshotTransfer> TransfersFor(const std::vector<std::set<int>>& needs,
                                           const HeldByOldRank& held) {
  std::vector<SnapshotTransfer> transfers;
  for (int r = 0; r < static_cast<int>(needs.size()); ++r) {
    for (int o : needs[r]) {
      const std::vector<int>& h = held.at(o).holders;
      if (std::find(h.begin(), h.end(), r) != h.end()) continue;
      transfers.push_back({h[(r + o) % h.size()], r, o});
    }
  }
  return transfers;
}

RecoveryDecision SnapshotDecision(const SnapshotKey& key, const HeldByOldRank& held,
                                  const ShardPlan& plan, int world) {
  RecoveryDecision d;
  d.source = RecoverySource::kSnapshot;
  std::tie(d.step, d.old_world_size, d.plan_hash) = key;
  const std::vector<std::set<int>> needs = OldRanksEachRankNeeds(plan, held, world);
  d.transfers = TransfersFor(needs, held);
  for (const std::set<int>& n : needs) d.needs.emplace_back(n.begin(), n.end());
  for (const auto& [old_rank, h] : held) d.blobs[old_rank] = {h.blob->bytes, h.blob->xxh64};
  d.why = absl::StrCat("in-memory snapshot held for all ", d.old_world_size, " old ranks; ",
                       d.transfers.size(), " transfers");
  return d;
}

}  // namespace

bool AnyRankHasState(const std::vector<RankHoldings>& holdings) {
  for (const RankHoldings& h : holdings) {
    if (h.survivor || !h.blobs.empty()) return true;
  }
  return false;
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
                              int64_t disk_step) {
  const int world = static_cast<int>(holdings.size());
  assert(plan.units.empty() || plan.world_size == world);
  RecoveryDecision d;
  if (!AnyRankHasState(holdings)) return d;  // kInitial
  const std::map<SnapshotKey, HeldByOldRank> groups = GroupBlobsBySnapshot(holdings);
  const auto* best = LatestCompleteSnapshot(groups);
  if (best != nullptr && std::get<0>(best->first) >= disk_step) {
    return SnapshotDecision(best->first, best->second, plan, world);
  }
  if (disk_step >= 0) {
    d.source = RecoverySource::kDisk;
    d.step = disk_step;
    d.why = best == nullptr ? "no in-memory snapshot step is held for every old rank (a rank "
                              "and its buddy lost?)"
                            : "the disk checkpoint is newer than the snapshots";
    return d;
  }
  d.source = RecoverySource::kScratch;
  d.step = 0;
  d.why =
      "neither an in-memory snapshot of every rank nor a complete disk checkpoint exists: "
      "starting again from the seed";
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
          {"pieces", pieces}};
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

}  // namespace

std::string RankHoldingsToJson(const RankHoldings& holdings) {
  json blobs = json::array();
  for (const BlobDescription& b : holdings.blobs) blobs.push_back(BlobToJson(b));
  return json({{"survivor", holdings.survivor}, {"blobs", blobs}}).dump();
}

absl::StatusOr<RankHoldings> RankHoldingsFromJson(absl::string_view text) {
  return ParseGuarded<RankHoldings>(text, "recovery holdings",
                                    [](const json& j) -> absl::StatusOr<RankHoldings> {
                                      RankHoldings h;
                                      h.survivor = j.at("survivor").get<bool>();
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
  for (const SnapshotTransfer& t : d.transfers) transfers.push_back({t.from, t.to, t.old_rank});
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
          d.transfers.push_back({t.at(0).get<int>(), t.at(1).get<int>(), t.at(2).get<int>()});
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
