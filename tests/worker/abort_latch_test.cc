#include "worker/abort_latch.h"

#include <atomic>
#include <string>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"

namespace zeroshard {
namespace {

TEST(AbortLatchTest, TheFirstTripWinsAndIsSeenFromOtherThreads) {
  AbortLatch latch(absl::Hours(1), [](const std::string&) { FAIL() << "watchdog fired"; });
  EXPECT_FALSE(latch.tripped());
  EXPECT_EQ(latch.message(), "");
  bool first = false;
  std::thread other([&] { first = latch.Trip("aborting during step 3: gone"); });
  other.join();
  EXPECT_TRUE(first);
  EXPECT_FALSE(latch.Trip("heartbeats refused"));
  EXPECT_TRUE(latch.tripped());
  EXPECT_EQ(latch.message(), "aborting during step 3: gone");
  latch.Disarm();
}

TEST(AbortLatchTest, TheWatchdogFiresWhenNotDisarmedInTime) {
  absl::Notification fired;
  std::string seen;
  AbortLatch latch(absl::Milliseconds(50), [&](const std::string& message) {
    seen = message;
    fired.Notify();
  });
  const absl::Time start = absl::Now();
  latch.Trip("stuck");
  ASSERT_TRUE(fired.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(50));
  EXPECT_EQ(seen, "stuck");
  EXPECT_EQ(latch.AwaitWatchdogSettled(absl::Seconds(10)), AbortLatch::Watchdog::kFired);
}

TEST(AbortLatchTest, ADisarmedWatchdogStandsDownWithoutFiring) {
  std::atomic<bool> fired{false};
  // The grace is an hour: a watchdog that settles within the test's deadline
  // did so because Disarm() reached it, not because the grace ran out.
  AbortLatch latch(absl::Hours(1), [&](const std::string&) { fired = true; });
  latch.Trip("handled");
  EXPECT_EQ(latch.AwaitWatchdogSettled(absl::ZeroDuration()), AbortLatch::Watchdog::kWatching);
  latch.Disarm();
  EXPECT_EQ(latch.AwaitWatchdogSettled(absl::Seconds(10)), AbortLatch::Watchdog::kStoodDown);
  EXPECT_FALSE(fired.load());
}

TEST(AbortLatchTest, DestroyingAnArmedLatchStandsTheWatchdogDown) {
  std::atomic<bool> fired{false};
  const absl::Time start = absl::Now();
  {
    AbortLatch latch(absl::Hours(1), [&](const std::string&) { fired = true; });
    latch.Trip("exiting anyway");
    EXPECT_EQ(latch.AwaitWatchdogSettled(absl::ZeroDuration()), AbortLatch::Watchdog::kWatching);
  }
  EXPECT_FALSE(fired.load());
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
}

TEST(AbortLatchTest, AnUntrippedLatchHasNoWatchdog) {
  AbortLatch latch(absl::Milliseconds(1), [](const std::string&) { FAIL() << "fired"; });
  EXPECT_EQ(latch.AwaitWatchdogSettled(absl::ZeroDuration()), AbortLatch::Watchdog::kNone);
  EXPECT_FALSE(latch.tripped());
}

}  // namespace
}  // namespace zeroshard
