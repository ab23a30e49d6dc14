// Waiting on words in memory shared by processes (the shared-memory
// collectives' published counters): futex wait and wake, spinning, and
// wrap-around counter comparison. Internal to worker/comm.
#ifndef ZEROSHARD_WORKER_COMM_SHM_FUTEX_H_
#define ZEROSHARD_WORKER_COMM_SHM_FUTEX_H_

#include <limits.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>

#include "absl/time/time.h"

namespace zeroshard {
namespace shm {

static_assert(std::atomic<uint32_t>::is_always_lock_free, "futex words must be lock-free");

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

inline void FutexWait(std::atomic<uint32_t>* word, uint32_t expected, absl::Duration timeout) {
  struct timespec ts = absl::ToTimespec(timeout);
  // Shared (not FUTEX_PRIVATE): the word lives in memory shared by processes.
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

inline void FutexWakeAll(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

// Whether a counter that counts up (and wraps) has reached `target`.
inline bool Reached(uint32_t value, uint32_t target) {
  return static_cast<int32_t>(value - target) >= 0;
}

}  // namespace shm
}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_COMM_SHM_FUTEX_H_
