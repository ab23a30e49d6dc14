// One thread that runs submitted tasks in submission order: the engine's
// communication threads (one for gathers, one for reductions), so that
// collectives overlap compute and every rank issues them in the same order.
#ifndef ZEROSHARD_WORKER_ZERO_TASK_THREAD_H_
#define ZEROSHARD_WORKER_ZERO_TASK_THREAD_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"

namespace zeroshard {

// Thread-safe.
class TaskThread {
 public:
  using Task = std::function<absl::Status()>;
  explicit TaskThread(std::string name);
  ~TaskThread();  // runs the queued tasks, then joins

  // Queues `task`; returns its ticket. Once a task failed, later tasks are
  // not run and report the first failure.
  int64_t Submit(Task task);
  // Blocks until the ticket's task ran; its status. REQUIRES: each ticket is
  // waited for at most once.
  absl::Status Wait(int64_t ticket);
  // Blocks until every submitted task ran; the first failure, if any.
  absl::Status Drain();
  // The first failure so far (OK if none), without waiting.
  absl::Status FirstError();

 private:
  void Loop();

  const std::string name_;
  absl::Mutex mu_;
  std::deque<std::pair<int64_t, Task>> queue_ ABSL_GUARDED_BY(mu_);
  std::map<int64_t, absl::Status> done_ ABSL_GUARDED_BY(mu_);  // finished, not yet waited for
  int64_t next_ticket_ ABSL_GUARDED_BY(mu_) = 1;
  int64_t completed_ ABSL_GUARDED_BY(mu_) = 0;  // tickets <= completed_ have run
  absl::Status first_error_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_ZERO_TASK_THREAD_H_
