// AbortLatch: how the end of a job generation, learned on another thread,
// reaches the training thread.
//
// The server ends a generation (a member died, or this member was fenced)
// through the heartbeat stream, whose thread is not the one training. That
// thread Trip()s the latch with the message to print and breaks the data
// plane; the training thread's blocked collective fails, the phases return
// their errors up to main, and main sees tripped(): it prints message() and
// exits 3, after tearing the process down in order.
//
// A thread may be blocked where no abort reaches it (a file write, an RPC
// with a long deadline), so Trip() also starts a watchdog: unless Disarm()
// is called within `grace`, it calls `expired(message)` on its own thread
// (shard_worker's exits the process).
//
// It latches once, for one generation: a process that goes on to join a
// later generation Reset()s it first.
//
// Thread-safe.
#ifndef ZEROSHARD_WORKER_ABORT_LATCH_H_
#define ZEROSHARD_WORKER_ABORT_LATCH_H_

#include <functional>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace zeroshard {

class AbortLatch {
 public:
  using ExpiredFn = std::function<void(const std::string& message)>;
  // The watchdog's life: none until the first Trip(), then watching until it
  // either stands down (Disarm) or fires (`expired` called).
  enum class Watchdog { kNone, kWatching, kStoodDown, kFired };

  AbortLatch(absl::Duration grace, ExpiredFn expired);
  // Stands the watchdog down (without calling `expired`) and joins it.
  ~AbortLatch();

  AbortLatch(const AbortLatch&) = delete;
  AbortLatch& operator=(const AbortLatch&) = delete;

  // Records `message` and starts the watchdog. Only the first call counts;
  // returns whether it was this one.
  bool Trip(const std::string& message) ABSL_LOCKS_EXCLUDED(mu_);
  // The abort has been handled (the process is about to exit, or the
  // generation's state is torn down): the watchdog stands down.
  void Disarm() ABSL_LOCKS_EXCLUDED(mu_);

  bool tripped() const ABSL_LOCKS_EXCLUDED(mu_);
  // Waits up to `timeout` for a Trip(); returns tripped().
  bool WaitTripped(absl::Duration timeout) const ABSL_LOCKS_EXCLUDED(mu_);
  // For the next generation of a worker that re-joins: disarms and joins the
  // watchdog, then clears the latch. REQUIRES: no thread calls Trip() now
  // (heartbeats stopped).
  void Reset() ABSL_LOCKS_EXCLUDED(mu_);
  // "" until tripped.
  std::string message() const ABSL_LOCKS_EXCLUDED(mu_);
  // For tests: waits up to `timeout` while the watchdog is kWatching, then
  // returns its state (kFired once `expired` has been called).
  Watchdog AwaitWatchdogSettled(absl::Duration timeout) const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  void Watch() ABSL_LOCKS_EXCLUDED(mu_);

  const absl::Duration grace_;
  const ExpiredFn expired_;

  mutable absl::Mutex mu_;
  bool tripped_ ABSL_GUARDED_BY(mu_) = false;
  bool disarmed_ ABSL_GUARDED_BY(mu_) = false;
  std::string message_ ABSL_GUARDED_BY(mu_);
  Watchdog watchdog_state_ ABSL_GUARDED_BY(mu_) = Watchdog::kNone;
  std::thread watchdog_;  // started by the first Trip(); joined by the destructor
};

}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_ABORT_LATCH_H_
