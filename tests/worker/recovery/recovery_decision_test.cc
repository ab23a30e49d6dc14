// DecideSource, every case, as a table; and the KV-edge codecs.
#include "worker/recovery/recovery_decision.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace zeroshard {
namespace {

// A plan of one unit with one tensor "w" of `rows` rows cut into `world`
// equal row blocks, block r on rank r.
ShardPlan RowBlockPlan(int world, int64_t rows) {
  ShardPlan plan;
  plan.world_size = world;
  plan.hash = "new";
  ShardUnit unit;
  unit.name = "u";
  TensorSpec w;
  w.name = "w";
  unit.tensors.push_back(w);
  const int64_t block = rows / world;
  for (int r = 0; r < world; ++r) unit.pieces.push_back({0, r * block, (r + 1) * block, r, 0});
  plan.units.push_back(unit);
  return plan;
}

// Old rank `rank`'s blob of `step` from a generation of `world` ranks that
// cut "w" (`rows` rows) the same way.
BlobDescription Blob(int64_t step, int rank, int world, int64_t rows = 12,
                     const std::string& plan_hash = "old") {
  const int64_t block = rows / world;
  BlobDescription b;
  b.step = step;
  b.rank = rank;
  b.world_size = world;
  b.plan_hash = plan_hash;
  b.bytes = 1000 + rank;
  b.xxh64 = 0xabc0 + rank;
  b.pieces = {{"w", rank * block, (rank + 1) * block}};
  return b;
}

RankHoldings Holds(bool survivor, std::vector<BlobDescription> blobs) {
  return {survivor, std::move(blobs)};
}

struct Case {
  std::string name;
  std::vector<RankHoldings> holdings;  // by new rank
  int64_t disk_step;
  RecoverySource source;
  int64_t step;
  int transfers;  // -1: not a snapshot
};

std::vector<Case> Cases() {
  return {
      {"NobodyHasStateIsAFreshJob",
       {Holds(false, {}), Holds(false, {})},
       7,
       RecoverySource::kInitial,
       0,
       -1},
      {"SurvivorsWithoutBlobsOrDiskStartFromTheSeed",
       {Holds(true, {}), Holds(false, {})},
       -1,
       RecoverySource::kScratch,
       0,
       -1},
      {"SurvivorsWithoutBlobsTakeTheDisk",
       {Holds(true, {}), Holds(false, {})},
       4,
       RecoverySource::kDisk,
       4,
       -1},
      // Rank 0 holds its own and its buddy's blob; the replacement (rank 1)
      // holds nothing: one transfer, 0 -> 1, of old rank 1.
      {"ReplacementTakesItsBuddysCopy",
       {Holds(true, {Blob(6, 0, 2), Blob(6, 1, 2)}), Holds(false, {})},
       -1,
       RecoverySource::kSnapshot,
       6,
       1},
      {"EveryRankHoldsItsOwnNoTransfers",
       {Holds(true, {Blob(6, 0, 2), Blob(6, 1, 2)}), Holds(true, {Blob(6, 1, 2), Blob(6, 0, 2)})},
       -1,
       RecoverySource::kSnapshot,
       6,
       0},
      {"ASnapshotAsNewAsTheDiskWins",
       {Holds(true, {Blob(6, 0, 2), Blob(6, 1, 2)}), Holds(false, {})},
       6,
       RecoverySource::kSnapshot,
       6,
       1},
      {"ANewerDiskCheckpointWins",
       {Holds(true, {Blob(6, 0, 2), Blob(6, 1, 2)}), Holds(false, {})},
       8,
       RecoverySource::kDisk,
       8,
       -1},
      // Old rank 1's blob is held by nobody (it and its buddy were lost).
      {"ARankAndItsBuddyLostTakesTheDisk",
       {Holds(true, {Blob(6, 0, 2)}), Holds(false, {})},
       3,
       RecoverySource::kDisk,
       3,
       -1},
      {"ARankAndItsBuddyLostWithoutDiskStartsFromTheSeed",
       {Holds(true, {Blob(6, 0, 2)}), Holds(false, {})},
       -1,
       RecoverySource::kScratch,
       0,
       -1},
      // Step 9 is incomplete; step 6 is complete: 6 is taken.
      {"TheLatestCompleteStepWins",
       {Holds(true, {Blob(6, 0, 2), Blob(6, 1, 2), Blob(9, 0, 2)}), Holds(true, {Blob(6, 1, 2)})},
       -1,
       RecoverySource::kSnapshot,
       6,
       0},
      // A shrink: three old ranks' blobs held by two survivors; the new plan
      // cuts "w" in two, so each new rank needs two old ranks' pieces.
      {"AShrinkReadsOldPiecesAcrossRanks",
       {Holds(true, {Blob(5, 0, 3), Blob(5, 2, 3)}), Holds(true, {Blob(5, 1, 3), Blob(5, 0, 3)})},
       -1,
       RecoverySource::kSnapshot,
       5,
       2},
  };
}

class DecideSourceTest : public testing::TestWithParam<Case> {};

TEST_P(DecideSourceTest, PicksTheCheapestTierThatHasTheState) {
  const Case& c = GetParam();
  const int world = static_cast<int>(c.holdings.size());
  const RecoveryDecision d = DecideSource(c.holdings, RowBlockPlan(world, 12), c.disk_step);
  EXPECT_EQ(RecoverySourceName(d.source), RecoverySourceName(c.source));
  if (c.source == RecoverySource::kInitial) return;
  EXPECT_EQ(d.step, c.step);
  EXPECT_FALSE(d.why.empty());
  if (c.transfers < 0) return;
  EXPECT_EQ(static_cast<int>(d.transfers.size()), c.transfers);
  ASSERT_EQ(static_cast<int>(d.needs.size()), world);
  for (const SnapshotTransfer& t : d.transfers) {
    // A transfer goes from a holder of the blob to a rank that needs it and
    // does not hold it.
    bool from_holds = false, to_holds = false;
    for (const BlobDescription& b : c.holdings[t.from].blobs) {
      from_holds = from_holds || (b.step == d.step && b.rank == t.old_rank);
    }
    for (const BlobDescription& b : c.holdings[t.to].blobs) {
      to_holds = to_holds || (b.step == d.step && b.rank == t.old_rank);
    }
    EXPECT_TRUE(from_holds) << t.from << " sends old rank " << t.old_rank;
    EXPECT_FALSE(to_holds) << t.to << " receives old rank " << t.old_rank;
    const std::vector<int>& needs = d.needs[t.to];
    EXPECT_NE(std::find(needs.begin(), needs.end(), t.old_rank), needs.end());
  }
}

INSTANTIATE_TEST_SUITE_P(EveryCase, DecideSourceTest, testing::ValuesIn(Cases()),
                         [](const testing::TestParamInfo<Case>& info) { return info.param.name; });

TEST(DecideSourceTest, AShrinkNeedsTheOldRanksItsRowsOverlap) {
  // Old: 3 ranks x 4 rows. New: 2 ranks x 6 rows. New rank 0 (rows 0-5)
  // overlaps old 0 (0-3) and old 1 (4-7); new rank 1 (6-11), old 1 and old 2.
  const std::vector<RankHoldings> holdings = {Holds(true, {Blob(5, 0, 3), Blob(5, 2, 3)}),
                                              Holds(true, {Blob(5, 1, 3), Blob(5, 0, 3)})};
  const RecoveryDecision d = DecideSource(holdings, RowBlockPlan(2, 12), -1);
  ASSERT_EQ(d.source, RecoverySource::kSnapshot);
  EXPECT_EQ(d.needs, (std::vector<std::vector<int>>{{0, 1}, {1, 2}}));
  EXPECT_EQ(d.old_world_size, 3);
  EXPECT_EQ(d.plan_hash, "old");
  ASSERT_EQ(d.blobs.size(), 3u);
  EXPECT_EQ(d.blobs.at(2).bytes, 1002);
  EXPECT_EQ(d.blobs.at(2).xxh64, 0xabc2u);
}

// HSDP, W = 4 in shard groups of 2 (planner.h): "w" (12 rows) is member 0's
// rows 0-5 and member 1's rows 6-11, each split in two runs over the
// replicas: rank 0 rows 0-2, rank 2 rows 3-5, rank 1 rows 6-8, rank 3 rows
// 9-11.
ShardPlan HsdpPlan() {
  ShardPlan plan = RowBlockPlan(4, 12);
  plan.options.shard_group_size = 2;
  plan.units[0].pieces = {{0, 0, 3, 0, 0}, {0, 6, 9, 1, 0}, {0, 3, 6, 2, 3}, {0, 9, 12, 3, 3}};
  return plan;
}

// A blob as an HSDP rank snapshots it with its replica peer's run: the rows
// of its whole member shard.
BlobDescription ReplicaBlob(int64_t step, int rank) {
  BlobDescription b = Blob(step, rank, 4);
  b.plan_hash = "hsdp";
  b.pieces = rank % 2 == 0 ? std::vector<RowRange>{{"w", 0, 3}, {"w", 3, 6}}
                           : std::vector<RowRange>{{"w", 6, 9}, {"w", 9, 12}};
  if (rank >= 2) std::swap(b.pieces[0], b.pieces[1]);  // its own run first
  return b;
}

TEST(DecideSourceTest, InHsdpALostRankIsRestoredFromItsReplica) {
  // Rank 3 lost; its replacement holds nothing. Rank 1 is member 1 of the
  // other group: its blob has rows 6-11, rank 3's run included.
  const std::vector<RankHoldings> holdings = {Holds(true, {ReplicaBlob(10, 0)}),
                                              Holds(true, {ReplicaBlob(10, 1)}),
                                              Holds(true, {ReplicaBlob(10, 2)}), Holds(false, {})};
  const RecoveryDecision d = DecideSource(holdings, HsdpPlan(), 0);
  ASSERT_EQ(d.source, RecoverySource::kSnapshot) << d.why;
  EXPECT_EQ(d.step, 10);
  EXPECT_EQ(d.needs, (std::vector<std::vector<int>>{{0}, {1}, {2}, {1}}));
  ASSERT_EQ(d.transfers.size(), 1u);
  EXPECT_EQ(d.transfers[0].from, 1);
  EXPECT_EQ(d.transfers[0].to, 3);
  EXPECT_EQ(d.transfers[0].old_rank, 1);
  EXPECT_EQ(TransferKindName(d.transfers[0].kind), "replica");
}

TEST(DecideSourceTest, InHsdpEveryReplicaOfAShardLostTakesTheDisk) {
  // Ranks 1 and 3 (both replicas of member 1) lost: rows 6-11 are nowhere.
  const std::vector<RankHoldings> holdings = {Holds(true, {ReplicaBlob(10, 0)}), Holds(false, {}),
                                              Holds(true, {ReplicaBlob(10, 2)}), Holds(false, {})};
  RecoveryDecision d = DecideSource(holdings, HsdpPlan(), 5);
  EXPECT_EQ(d.source, RecoverySource::kDisk);
  EXPECT_EQ(d.step, 5);
  EXPECT_NE(d.why.find("every replica"), std::string::npos) << d.why;
  d = DecideSource(holdings, HsdpPlan(), -1);
  EXPECT_EQ(d.source, RecoverySource::kScratch);
}

TEST(DecideSourceTest, ASourceOnTheReplacementsHostAndItsSaverArePreferred) {
  // Old rank 3's blob: saved by nobody alive, copies on ranks 1 (host a) and
  // 2 (host b); the replacement runs on host b.
  std::vector<RankHoldings> holdings = {
      Holds(true, {Blob(6, 0, 4, 8)}), Holds(true, {Blob(6, 1, 4, 8), Blob(6, 3, 4, 8)}),
      Holds(true, {Blob(6, 2, 4, 8), Blob(6, 3, 4, 8)}), Holds(false, {})};
  for (int r = 0; r < 4; ++r) holdings[r].host = r < 2 ? "a" : "b";
  for (BlobDescription& b : holdings[1].blobs) b.received = b.rank == 3;
  for (BlobDescription& b : holdings[2].blobs) b.received = b.rank == 3;
  RecoveryDecision d = DecideSource(holdings, RowBlockPlan(4, 8), -1);
  ASSERT_EQ(d.transfers.size(), 1u);
  EXPECT_EQ(d.transfers[0].from, 2);
  EXPECT_EQ(TransferKindName(d.transfers[0].kind), "buddy");
  // On one host, the rank that saved it goes before one holding a copy.
  for (RankHoldings& h : holdings) h.host = "a";
  holdings[1].blobs[1].received = false;
  d = DecideSource(holdings, RowBlockPlan(4, 8), -1);
  ASSERT_EQ(d.transfers.size(), 1u);
  EXPECT_EQ(d.transfers[0].from, 1);
  EXPECT_EQ(TransferKindName(d.transfers[0].kind), "peer");
}

TEST(DecideSourceTest, WithThreeReplicasTheLostRunsComeFromTwoReplicas) {
  // W = 6 in groups of 2 (R = 3): member 0's rows 0-5 are runs 0-1, 2-3 and
  // 4-5 on ranks 0, 2 and 4; each blob holds its own run and the next
  // replica's (0 -> 2 -> 4 -> 0). Rank 2 lost: its run 2-3 is in rank 0's
  // blob, the run 4-5 it computes on too in rank 4's.
  ShardPlan plan = RowBlockPlan(6, 12);
  plan.options.shard_group_size = 2;
  plan.units[0].pieces = {{0, 0, 2, 0, 0},  {0, 6, 8, 1, 0}, {0, 2, 4, 2, 2},
                          {0, 8, 10, 3, 2}, {0, 4, 6, 4, 4}, {0, 10, 12, 5, 4}};
  auto blob = [](int rank) {
    BlobDescription b = Blob(10, rank, 6);
    const int64_t own = (rank / 2) * 2 + (rank % 2) * 6;
    const int64_t next = ((rank / 2 + 1) % 3) * 2 + (rank % 2) * 6;
    b.pieces = {{"w", own, own + 2}, {"w", next, next + 2}};
    return b;
  };
  std::vector<RankHoldings> holdings;
  for (int r = 0; r < 6; ++r) {
    holdings.push_back(r == 2 ? Holds(false, {}) : Holds(true, {blob(r)}));
  }
  RecoveryDecision d = DecideSource(holdings, plan, -1);
  ASSERT_EQ(d.source, RecoverySource::kSnapshot) << d.why;
  EXPECT_EQ(d.needs[2], (std::vector<int>{0, 4}));
  // A blob holds two of the three runs a rank computes on, so every rank
  // receives one (a survivor its third run), each from the replica that
  // saved it.
  int to_replacement = 0;
  for (const SnapshotTransfer& t : d.transfers) {
    to_replacement += t.to == 2;
    EXPECT_EQ(t.from, t.old_rank);
    EXPECT_EQ(t.from % 2, t.to % 2);
    EXPECT_EQ(TransferKindName(t.kind), "replica");
  }
  EXPECT_EQ(to_replacement, 2);
  EXPECT_EQ(d.transfers.size(), 7u);
  // Rank 4 lost as well: run 4-5 was in blobs 2 and 4 only.
  holdings[4] = Holds(false, {});
  d = DecideSource(holdings, plan, 3);
  EXPECT_EQ(d.source, RecoverySource::kDisk);
}

TEST(DecideSourceTest, ReplicatedParametersNeedEveryRowOnEveryRank) {
  // Stages 0-2 load every parameter row: the survivor needs its buddy copy
  // of old rank 1 as well as its own blob, and the replacement both.
  const std::vector<RankHoldings> holdings = {Holds(true, {Blob(6, 0, 2), Blob(6, 1, 2)}),
                                              Holds(false, {})};
  const RecoveryDecision d = DecideSource(holdings, RowBlockPlan(2, 12), -1, /*every_row=*/true);
  ASSERT_EQ(d.source, RecoverySource::kSnapshot);
  EXPECT_EQ(d.needs, (std::vector<std::vector<int>>{{0, 1}, {0, 1}}));
  EXPECT_EQ(d.transfers.size(), 2u);
  // In HSDP with replica blobs, every rank reads both members' rows.
  const std::vector<RankHoldings> hsdp = {Holds(true, {ReplicaBlob(10, 0)}),
                                          Holds(true, {ReplicaBlob(10, 1)}),
                                          Holds(true, {ReplicaBlob(10, 2)}), Holds(false, {})};
  const RecoveryDecision h = DecideSource(hsdp, HsdpPlan(), -1, /*every_row=*/true);
  ASSERT_EQ(h.source, RecoverySource::kSnapshot);
  for (const std::vector<int>& n : h.needs) EXPECT_EQ(n.size(), 2u);
}

TEST(RecoveryCodecTest, ADecisionSurvivesTheKvStore) {
  const std::vector<RankHoldings> holdings = {Holds(true, {Blob(5, 0, 3), Blob(5, 2, 3)}),
                                              Holds(true, {Blob(5, 1, 3), Blob(5, 0, 3)})};
  const RecoveryDecision d = DecideSource(holdings, RowBlockPlan(2, 12), -1);
  absl::StatusOr<RecoveryDecision> back = RecoveryDecisionFromJson(RecoveryDecisionToJson(d));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->source, d.source);
  EXPECT_EQ(back->step, d.step);
  EXPECT_EQ(back->why, d.why);
  EXPECT_EQ(back->old_world_size, d.old_world_size);
  EXPECT_EQ(back->plan_hash, d.plan_hash);
  EXPECT_EQ(back->needs, d.needs);
  ASSERT_EQ(back->transfers.size(), d.transfers.size());
  for (size_t i = 0; i < d.transfers.size(); ++i) {
    EXPECT_EQ(back->transfers[i].from, d.transfers[i].from);
    EXPECT_EQ(back->transfers[i].to, d.transfers[i].to);
    EXPECT_EQ(back->transfers[i].old_rank, d.transfers[i].old_rank);
    EXPECT_EQ(back->transfers[i].kind, d.transfers[i].kind);
  }
  ASSERT_EQ(back->blobs.size(), d.blobs.size());
  for (const auto& [rank, size] : d.blobs) {
    EXPECT_EQ(back->blobs.at(rank).bytes, size.bytes);
    EXPECT_EQ(back->blobs.at(rank).xxh64, size.xxh64);
  }
}

TEST(RecoveryCodecTest, HoldingsSurviveTheKvStore) {
  RankHoldings mine = Holds(true, {Blob(5, 1, 3), Blob(7, 0, 3, 12, "other")});
  mine.host = "node-7";
  mine.blobs[1].received = true;
  absl::StatusOr<RankHoldings> back = RankHoldingsFromJson(RankHoldingsToJson(mine));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(back->survivor);
  ASSERT_EQ(back->blobs.size(), 2u);
  EXPECT_EQ(back->blobs[1].step, 7);
  EXPECT_EQ(back->blobs[1].plan_hash, "other");
  EXPECT_EQ(back->blobs[1].xxh64, mine.blobs[1].xxh64);
  EXPECT_EQ(back->host, "node-7");
  EXPECT_FALSE(back->blobs[0].received);
  EXPECT_TRUE(back->blobs[1].received);
  ASSERT_EQ(back->blobs[0].pieces.size(), 1u);
  EXPECT_EQ(back->blobs[0].pieces[0].tensor, "w");
  EXPECT_EQ(back->blobs[0].pieces[0].row_begin, 4);
  EXPECT_EQ(back->blobs[0].pieces[0].row_end, 8);
}

TEST(RecoveryCodecTest, MalformedTextIsAClearErrorNotACrash) {
  for (const char* text :
       {"", "not json", "[1,2]", R"({"survivor": "yes", "blobs": []})", R"({"survivor": true})",
        R"({"survivor": true, "blobs": [{"step": 1}]})"}) {
    absl::StatusOr<RankHoldings> h = RankHoldingsFromJson(text);
    EXPECT_EQ(h.status().code(), absl::StatusCode::kInvalidArgument) << text;
    EXPECT_NE(h.status().message().find("recovery holdings"), absl::string_view::npos) << text;
  }
  for (const char* text :
       {"{}", R"({"source": "tape", "step": 1})", R"({"source": "snapshot", "step": 1})",
        R"({"source": "disk", "step": "x"})"}) {
    EXPECT_EQ(RecoveryDecisionFromJson(text).status().code(), absl::StatusCode::kInvalidArgument)
        << text;
  }
}

}  // namespace
}  // namespace zeroshard
