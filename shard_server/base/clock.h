// Time source for the server's timers, so that the health monitor can be
// tested with a fake clock.
#ifndef ZEROSHARD_SHARD_SERVER_BASE_CLOCK_H_
#define ZEROSHARD_SHARD_SERVER_BASE_CLOCK_H_

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace zeroshard {

// Thread-safe.
class Clock {
 public:
  virtual ~Clock() = default;
  virtual absl::Time Now() = 0;
};

class RealClock : public Clock {
 public:
  absl::Time Now() override { return absl::Now(); }
};

// A clock that moves only when told to. Thread-safe.
class FakeClock : public Clock {
 public:
  explicit FakeClock(absl::Time start = absl::FromUnixSeconds(1'800'000'000)) : now_(start) {}
  absl::Time Now() override {
    absl::MutexLock lock(&mu_);
    return now_;
  }
  void Advance(absl::Duration d) {
    absl::MutexLock lock(&mu_);
    now_ += d;
  }

 private:
  absl::Mutex mu_;
  absl::Time now_ ABSL_GUARDED_BY(mu_);
};

}  // namespace zeroshard

#endif  // ZEROSHARD_SHARD_SERVER_BASE_CLOCK_H_
