#include "worker/abort_latch.h"

#include <utility>

namespace zeroshard {

AbortLatch::AbortLatch(absl::Duration grace, ExpiredFn expired)
    : grace_(grace), expired_(std::move(expired)) {}

AbortLatch::~AbortLatch() {
  Disarm();
  // Only Trip() (under mu_, once) starts the thread; by now no other thread
  // may call Trip() (they are gone before their latch is).
  if (watchdog_.joinable()) watchdog_.join();
}

bool AbortLatch::Trip(const std::string& message) {
  absl::MutexLock lock(&mu_);
  if (tripped_) return false;
  tripped_ = true;
  message_ = message;
  watchdog_state_ = Watchdog::kWatching;
  watchdog_ = std::thread([this] { Watch(); });
  return true;
}

void AbortLatch::Disarm() {
  absl::MutexLock lock(&mu_);
  disarmed_ = true;
}

bool AbortLatch::tripped() const {
  absl::MutexLock lock(&mu_);
  return tripped_;
}

bool AbortLatch::WaitTripped(absl::Duration timeout) const {
  absl::MutexLock lock(&mu_);
  auto tripped = [this] { return tripped_; };
  return mu_.AwaitWithTimeout(absl::Condition(&tripped), timeout);
}

void AbortLatch::Reset() {
  Disarm();
  if (watchdog_.joinable()) watchdog_.join();
  absl::MutexLock lock(&mu_);
  tripped_ = false;
  disarmed_ = false;
  message_.clear();
  watchdog_state_ = Watchdog::kNone;
}

std::string AbortLatch::message() const {
  absl::MutexLock lock(&mu_);
  return message_;
}

AbortLatch::Watchdog AbortLatch::AwaitWatchdogSettled(absl::Duration timeout) const {
  absl::MutexLock lock(&mu_);
  auto settled = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return watchdog_state_ != Watchdog::kWatching;
  };
  mu_.AwaitWithTimeout(absl::Condition(&settled), timeout);
  return watchdog_state_;
}

void AbortLatch::Watch() {
  std::string message;
  {
    absl::MutexLock lock(&mu_);
    auto disarmed = [this] { return disarmed_; };
    if (mu_.AwaitWithTimeout(absl::Condition(&disarmed), grace_)) {
      watchdog_state_ = Watchdog::kStoodDown;
      return;
    }
    message = message_;
  }
  // Outside the lock: `expired_` usually never returns.
  expired_(message);
  absl::MutexLock lock(&mu_);
  watchdog_state_ = Watchdog::kFired;
}

}  // namespace zeroshard
