// HistoryStore: what it records, how it thins a rank over its bound (the rule
// in history_store.h), and that a reopened file goes on where it stopped.
#include "shard_server/observability/history_store.h"

#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "tests/testing/process.h"

namespace zeroshard {
namespace {

// The server's status with every rank of `job` (of `world` ranks) at `step`.
v1::GetStatusResponse StatusAt(const std::string& job, int world, int64_t step) {
  v1::GetStatusResponse status;
  v1::JobStatus* j = status.add_jobs();
  j->set_job_id(job);
  j->set_world_size(world);
  for (int r = 0; r < world; ++r) {
    v1::MemberStatus* m = j->add_members();
    m->set_rank(r);
    m->set_step(step);
    m->set_last_heartbeat_age_ms(0);
    m->set_loss(1.0 / static_cast<double>(step));
    m->set_memory_bytes(1000 + r);
    m->mutable_last_step()->set_step_ms(10.0);
    m->mutable_last_step()->set_items_per_second(800.0);
  }
  return status;
}

std::vector<int64_t> Steps(HistoryStore& store, const std::string& job, int rank) {
  absl::StatusOr<std::vector<v1::HistoryPoint>> points = store.Points(job, rank);
  EXPECT_TRUE(points.ok()) << points.status();
  std::vector<int64_t> steps;
  if (points.ok()) {
    for (const v1::HistoryPoint& p : *points) steps.push_back(p.step());
  }
  return steps;
}

const absl::Time kStart = absl::FromUnixSeconds(1'800'000'000);

TEST(HistoryStoreTest, RecordsEachNewStepOfEveryRankOnce) {
  auto store = HistoryStore::Open(":memory:");
  ASSERT_TRUE(store.ok()) << store.status();
  ASSERT_TRUE((*store)->Record(StatusAt("job", 2, 1), kStart).ok());
  ASSERT_TRUE((*store)->Record(StatusAt("job", 2, 1), kStart + absl::Seconds(1)).ok());
  ASSERT_TRUE((*store)->Record(StatusAt("job", 2, 2), kStart + absl::Seconds(2)).ok());
  absl::StatusOr<std::vector<v1::HistoryPoint>> points = (*store)->Points("job");
  ASSERT_TRUE(points.ok()) << points.status();
  ASSERT_EQ(points->size(), 4u);  // by rank, then step
  EXPECT_EQ((*points)[0].rank(), 0);
  EXPECT_EQ((*points)[0].step(), 1);
  EXPECT_EQ((*points)[0].unix_ms(), absl::ToUnixMillis(kStart));  // the first sighting
  EXPECT_EQ((*points)[1].step(), 2);
  EXPECT_EQ((*points)[1].loss(), 0.5);
  EXPECT_EQ((*points)[2].rank(), 1);
  EXPECT_EQ((*points)[3].memory_bytes(), 1001);
  EXPECT_EQ(Steps(**store, "job", 1), (std::vector<int64_t>{1, 2}));
}

// A Record writes at most max_points_per_record points of a job, taking the
// ranks in turn: a large job's ranks are all recorded, over several passes.
TEST(HistoryStoreTest, ARecordWritesAtMostItsBudgetTakingTheRanksInTurn) {
  HistoryOptions options;
  options.max_points_per_record = 2;
  auto store = HistoryStore::Open(":memory:", options);
  ASSERT_TRUE(store.ok()) << store.status();
  auto ranks_with_points = [&] {
    std::vector<int> ranks;
    absl::StatusOr<std::vector<v1::HistoryPoint>> points = (*store)->Points("job");
    EXPECT_TRUE(points.ok()) << points.status();
    for (const v1::HistoryPoint& p : *points) ranks.push_back(p.rank());
    return ranks;
  };
  ASSERT_TRUE((*store)->Record(StatusAt("job", 5, 1), kStart).ok());
  EXPECT_EQ(ranks_with_points(), (std::vector<int>{0, 1}));
  ASSERT_TRUE((*store)->Record(StatusAt("job", 5, 1), kStart).ok());
  EXPECT_EQ(ranks_with_points(), (std::vector<int>{0, 1, 2, 3}));
  // Rank 4 is next; ranks 0 and 1 have nothing new and are passed over.
  ASSERT_TRUE((*store)->Record(StatusAt("job", 5, 1), kStart).ok());
  EXPECT_EQ(ranks_with_points(), (std::vector<int>{0, 1, 2, 3, 4}));
  // A new step: the turn goes on from rank 4 (the last pass went round).
  ASSERT_TRUE((*store)->Record(StatusAt("job", 5, 2), kStart).ok());
  EXPECT_EQ(Steps(**store, "job", 4), (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(Steps(**store, "job", 0), (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(Steps(**store, "job", 1), (std::vector<int64_t>{1}));
}

TEST(HistoryStoreTest, RanksNotYetHeardFromOrBeforeTheirFirstStepAreSkipped) {
  auto store = HistoryStore::Open(":memory:");
  ASSERT_TRUE(store.ok()) << store.status();
  v1::GetStatusResponse status = StatusAt("job", 2, 0);
  status.mutable_jobs(0)->mutable_members(1)->set_step(5);
  status.mutable_jobs(0)->mutable_members(1)->set_last_heartbeat_age_ms(-1);
  ASSERT_TRUE((*store)->Record(status, kStart).ok());
  EXPECT_TRUE(Steps(**store, "job", -1).empty());
}

// Bound 16 per rank: at the 17th point the rank keeps its newest 8 and every
// other older one, starting from the newest of those.
TEST(HistoryStoreTest, ARankOverItsBoundKeepsItsNewestHalfAndEveryOtherOlderPoint) {
  HistoryOptions options;
  options.max_points_per_job = 16;
  options.min_points_per_rank = 8;
  auto store = HistoryStore::Open(":memory:", options);
  ASSERT_TRUE(store.ok()) << store.status();
  ASSERT_EQ((*store)->PointsPerRank(1), 16);
  for (int64_t step = 1; step <= 16; ++step) {
    ASSERT_TRUE((*store)->Record(StatusAt("job", 1, step), kStart).ok());
  }
  EXPECT_EQ(Steps(**store, "job", 0).size(), 16u);  // at the bound: nothing thinned
  ASSERT_TRUE((*store)->Record(StatusAt("job", 1, 17), kStart).ok());
  EXPECT_EQ(Steps(**store, "job", 0),
            (std::vector<int64_t>{1, 3, 5, 7, 9, 10, 11, 12, 13, 14, 15, 16, 17}));
}

TEST(HistoryStoreTest, TheBoundIsSharedByTheRanksAndHoldsOverALongRun) {
  HistoryOptions options;
  options.max_points_per_job = 64;
  options.min_points_per_rank = 8;
  auto store = HistoryStore::Open(":memory:", options);
  ASSERT_TRUE(store.ok()) << store.status();
  const int64_t cap = (*store)->PointsPerRank(2);
  ASSERT_EQ(cap, 32);
  EXPECT_EQ((*store)->PointsPerRank(64), 8);  // never below min_points_per_rank
  constexpr int64_t kSteps = 1000;
  for (int64_t step = 1; step <= kSteps; ++step) {
    ASSERT_TRUE((*store)->Record(StatusAt("job", 2, step), kStart).ok());
    for (int r = 0; r < 2; ++r) {
      ASSERT_LE(static_cast<int64_t>(Steps(**store, "job", r).size()), cap) << "step " << step;
    }
  }
  for (int r = 0; r < 2; ++r) {
    const std::vector<int64_t> steps = Steps(**store, "job", r);
    // The newest cap / 2 steps are all there, at full resolution.
    ASSERT_GE(static_cast<int64_t>(steps.size()), cap / 2);
    for (int64_t i = 0; i < cap / 2; ++i) {
      EXPECT_EQ(steps[steps.size() - 1 - i], kSteps - i) << "rank " << r;
    }
    // Thinning happens at cap + 1 points (odd), so the oldest point is never
    // an even one out: the first step stays.
    EXPECT_EQ(steps.front(), 1) << "rank " << r;
  }
}

// #29 finding 5: a rank whose reported step goes down (1000, 999, ...)
// inserted a point every time without counting it, past any bound.
TEST(HistoryStoreTest, TheBoundHoldsWhenTheStepGoesDown) {
  HistoryOptions options;
  options.max_points_per_job = 64;
  options.min_points_per_rank = 8;
  auto store = HistoryStore::Open(":memory:", options);
  ASSERT_TRUE(store.ok()) << store.status();
  const int64_t cap = (*store)->PointsPerRank(2);
  for (int64_t step = 1000; step >= 1; --step) {
    ASSERT_TRUE((*store)->Record(StatusAt("job", 2, step), kStart).ok());
    for (int r = 0; r < 2; ++r) {
      ASSERT_LE(static_cast<int64_t>(Steps(**store, "job", r).size()), cap) << "step " << step;
    }
  }
  // Up and down by turns: the same.
  for (int64_t i = 0; i < 1000; ++i) {
    const int64_t step = i % 2 == 0 ? 5000 + i : 4000 - i;
    ASSERT_TRUE((*store)->Record(StatusAt("job", 2, step), kStart).ok());
  }
  for (int r = 0; r < 2; ++r) EXPECT_LE(static_cast<int64_t>(Steps(**store, "job", r).size()), cap);
}

TEST(HistoryStoreTest, ANaNLossReadsBackAsNaN) {
  auto store = HistoryStore::Open(":memory:");
  ASSERT_TRUE(store.ok()) << store.status();
  v1::GetStatusResponse status = StatusAt("job", 1, 7);
  status.mutable_jobs(0)->mutable_members(0)->set_loss(std::nan(""));
  ASSERT_TRUE((*store)->Record(status, kStart).ok());
  absl::StatusOr<std::vector<v1::HistoryPoint>> points = (*store)->Points("job");
  ASSERT_TRUE(points.ok()) << points.status();
  ASSERT_EQ(points->size(), 1u);
  EXPECT_TRUE(std::isnan((*points)[0].loss())) << (*points)[0].loss();
}

TEST(HistoryStoreTest, AStepSeenAgainReplacesItsPoint) {
  auto store = HistoryStore::Open(":memory:");
  ASSERT_TRUE(store.ok()) << store.status();
  ASSERT_TRUE((*store)->Record(StatusAt("job", 1, 5), kStart).ok());
  ASSERT_TRUE((*store)->Record(StatusAt("job", 1, 6), kStart).ok());
  // A resumed generation reports step 5 again.
  v1::GetStatusResponse again = StatusAt("job", 1, 5);
  again.mutable_jobs(0)->mutable_members(0)->set_loss(0.125);
  ASSERT_TRUE((*store)->Record(again, kStart + absl::Seconds(9)).ok());
  absl::StatusOr<std::vector<v1::HistoryPoint>> points = (*store)->Points("job", 0);
  ASSERT_TRUE(points.ok()) << points.status();
  ASSERT_EQ(points->size(), 2u);
  EXPECT_EQ((*points)[0].step(), 5);
  EXPECT_EQ((*points)[0].loss(), 0.125);
  EXPECT_EQ((*points)[0].unix_ms(), absl::ToUnixMillis(kStart + absl::Seconds(9)));
}

TEST(HistoryStoreTest, AReopenedFileKeepsItsPointsAndItsBound) {
  const std::string path = testing::MakeTempDir("history") + "/history.db";
  HistoryOptions options;
  options.max_points_per_job = 16;
  options.min_points_per_rank = 8;
  {
    auto store = HistoryStore::Open(path, options);
    ASSERT_TRUE(store.ok()) << store.status();
    for (int64_t step = 1; step <= 16; ++step) {
      ASSERT_TRUE((*store)->Record(StatusAt("job", 1, step), kStart).ok());
    }
  }
  auto store = HistoryStore::Open(path, options);
  ASSERT_TRUE(store.ok()) << store.status();
  EXPECT_EQ(Steps(**store, "job", 0).size(), 16u);
  // The count came back from the file: the next point thins as before.
  ASSERT_TRUE((*store)->Record(StatusAt("job", 1, 17), kStart).ok());
  EXPECT_EQ(Steps(**store, "job", 0).size(), 13u);
  ASSERT_TRUE((*store)->ForgetJob("job").ok());
  EXPECT_TRUE(Steps(**store, "job", -1).empty());
}

}  // namespace
}  // namespace zeroshard
