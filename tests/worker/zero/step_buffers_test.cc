// The step path's planning pieces: BufferPool (memory_tracker.h) lends
// planned buffers with honest accounting, and GatherWindow (gather_window.h)
// walks stage 3's window to the number of gathered units alive at once.
#include <thread>

#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "worker/zero/gather_window.h"
#include "worker/zero/memory_tracker.h"

namespace zeroshard {
namespace {

using ::testing::HasSubstr;

TEST(BufferPoolTest, LentBytesCountInTheirCategoryAndIdleOnesAsCached) {
  MemoryTracker tracker;
  {
    BufferPool pool("test");
    pool.Reserve(&tracker, 1024);
    pool.Reserve(&tracker, 256);
    EXPECT_EQ(tracker.current(MemoryCategory::kPoolCached), 1280);
    const int64_t allocations = tracker.allocations();
    absl::StatusOr<TrackedBuffer> a = pool.Lend(MemoryCategory::kCommBuffers, 200, true);
    ASSERT_TRUE(a.ok()) << a.status();
    EXPECT_EQ(a->bytes(), 200);
    // The smallest buffer that fits: the 256-byte one, zeroed.
    for (int i = 0; i < 50; ++i) EXPECT_EQ(a->f32()[i], 0.0f);
    EXPECT_EQ(tracker.current(MemoryCategory::kCommBuffers), 200);
    EXPECT_EQ(tracker.current(MemoryCategory::kPoolCached), 1080);
    absl::StatusOr<TrackedBuffer> b = pool.Lend(MemoryCategory::kParamsGathered, 600, false);
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_EQ(pool.lent(), 2);
    EXPECT_EQ(tracker.allocations(), allocations);  // lending allocates nothing
    a->Reset();
    EXPECT_EQ(tracker.current(MemoryCategory::kCommBuffers), 0);
    EXPECT_EQ(pool.lent(), 1);
    // Moved, a lent buffer still goes back once.
    TrackedBuffer moved = std::move(*b);
    moved = TrackedBuffer();
    EXPECT_EQ(pool.lent(), 0);
    EXPECT_EQ(tracker.current(MemoryCategory::kParamsGathered), 0);
    EXPECT_EQ(tracker.current(MemoryCategory::kPoolCached), 1280);
  }
  // The pool's buffers went back to the tracker (kept there for reuse).
  EXPECT_EQ(tracker.current(MemoryCategory::kCommBuffers), 0);
}

TEST(BufferPoolTest, APlanTooSmallIsAnErrorNamingThePool) {
  MemoryTracker tracker;
  BufferPool pool("flat gradients");
  pool.Reserve(&tracker, 512);
  absl::StatusOr<TrackedBuffer> held = pool.Lend(MemoryCategory::kGradsTransient, 512, false);
  ASSERT_TRUE(held.ok());
  absl::StatusOr<TrackedBuffer> none = pool.Lend(MemoryCategory::kGradsTransient, 64, false);
  EXPECT_EQ(none.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(none.status().message(), HasSubstr("'flat gradients'"));
  absl::StatusOr<TrackedBuffer> too_big =
      BufferPool("empty").Lend(MemoryCategory::kGradsTransient, 1, false);
  EXPECT_EQ(too_big.status().code(), absl::StatusCode::kResourceExhausted);
}

TEST(BufferPoolTest, ALendWaitsForABufferAnotherThreadGivesBack) {
  MemoryTracker tracker;
  BufferPool pool("test");
  pool.Reserve(&tracker, 128);
  absl::StatusOr<TrackedBuffer> held = pool.Lend(MemoryCategory::kCommBuffers, 128, false);
  ASSERT_TRUE(held.ok());
  TrackedBuffer given = std::move(*held);
  std::thread giver([&given] {
    absl::SleepFor(absl::Milliseconds(50));
    given.Reset();
  });
  // Waits until the other thread gives it back (well inside a minute).
  absl::StatusOr<TrackedBuffer> again =
      pool.Lend(MemoryCategory::kCommBuffers, 128, false, absl::Minutes(1));
  giver.join();
  EXPECT_TRUE(again.ok()) << again.status();
}

// Positions of a pass over `units` forward ops (then the same ops backward).
std::vector<int> Pass(std::vector<int> ops) {
  std::vector<int> positions = ops;
  for (int k = static_cast<int>(ops.size()) - 1; k >= 0; --k) positions.push_back(ops[k]);
  return positions;
}

TEST(GatherWindowTest, OnePlusPrefetchUnitsOfDistinctOpsUntilTheWindowReachesAMirror) {
  // engine.h's window: 1 + prefetch units unsharded at once.
  for (int prefetch = 0; prefetch <= 2; ++prefetch) {
    GatherWindow window(Pass({0, 1, 2, 3, 4, 5}), prefetch);
    EXPECT_EQ(window.PeakUnits(), 1 + prefetch) << "prefetch " << prefetch;
  }
  // Prefetch 3 over 6 ops: forward position 4's window reaches its own
  // backward mirror (position 7) before position 4 is released, so unit 4
  // is gathered a second time meanwhile (the hand-over never replaces a
  // gather in flight): one unit more. The pool is planned from this walk.
  EXPECT_EQ(GatherWindow(Pass({0, 1, 2, 3, 4, 5}), 3).PeakUnits(), 5);
}

TEST(GatherWindowTest, TheSameUnitTwiceInARowIsHandedOverNotGathered) {
  GatherWindow window(Pass({0, 1, 2}), 1);
  EXPECT_FALSE(window.TakesOver(2));
  EXPECT_TRUE(window.TakesOver(3));  // forward op 2, then its backward
  EXPECT_EQ(window.HandOverTarget(2, /*backward_follows=*/true), 3);
  EXPECT_EQ(window.HandOverTarget(2, /*backward_follows=*/false), -1);  // evaluation
  // The last `prefetch` forward positions before it keep their unit for
  // their backward mirror.
  EXPECT_EQ(window.HandOverTarget(1, true), 4);
  EXPECT_EQ(window.HandOverTarget(0, true), -1);
  EXPECT_TRUE(GatherWindow::HandsOver(1, 4, /*next_has_slot=*/false));
  EXPECT_FALSE(GatherWindow::HandsOver(1, 4, /*next_has_slot=*/true));
}

TEST(GatherWindowTest, ATiedUnitIsGatheredAtEachOfItsPositions) {
  // The GPT's tied head: unit 0 at the first and the last op.
  GatherWindow window(Pass({0, 1, 2, 0}), 1);
  EXPECT_EQ(window.IssueEnd(0, 7), 1);
  EXPECT_EQ(window.IssueEnd(4, 7), 5);  // one ahead in the backward
  EXPECT_EQ(window.EarlyEnd(), 1);
  EXPECT_EQ(window.PeakUnits(), 2);
}

}  // namespace
}  // namespace zeroshard
