#include "worker/zero/task_thread.h"

#include <pthread.h>

#include <new>
#include <utility>

#include "absl/strings/str_cat.h"

namespace zeroshard {

TaskThread::TaskThread(std::string name) : name_(std::move(name)) {
  thread_ = std::thread([this] {
    // "zs-gather", "zs-reduce", ...: what top -H and perf show (15 chars max).
    pthread_setname_np(pthread_self(), ("zs-" + name_).substr(0, 15).c_str());
    Loop();
  });
}

TaskThread::~TaskThread() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  thread_.join();
}

int64_t TaskThread::Submit(Task task) {
  absl::MutexLock lock(&mu_);
  int64_t ticket = next_ticket_++;
  queue_.emplace_back(ticket, std::move(task));
  return ticket;
}

void TaskThread::Loop() {
  while (true) {
    std::pair<int64_t, Task> item;
    absl::Status failed;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this] { return stop_ || !queue_.empty(); };
      mu_.Await(absl::Condition(&ready));
      if (queue_.empty()) return;  // stop_ and drained
      item = std::move(queue_.front());
      queue_.pop_front();
      failed = first_error_;
    }
    absl::Status status = failed;
    if (failed.ok()) {
      try {
        status = item.second();
      } catch (const std::bad_alloc&) {
        // Out of memory (MemoryTracker says where on stderr): a status the
        // compute thread reports, instead of std::terminate on this thread.
        status = absl::ResourceExhaustedError(
            absl::StrCat("task thread '", name_, "': out of memory"));
      }
    }
    absl::MutexLock lock(&mu_);
    if (!status.ok() && first_error_.ok()) first_error_ = status;
    done_[item.first] = status;
    completed_ = item.first;
  }
}

absl::Status TaskThread::Wait(int64_t ticket) {
  absl::MutexLock lock(&mu_);
  auto finished = [this, ticket] { return completed_ >= ticket; };
  mu_.Await(absl::Condition(&finished));
  auto it = done_.find(ticket);
  absl::Status status = it == done_.end() ? absl::OkStatus() : it->second;
  if (it != done_.end()) done_.erase(it);
  return status;
}

absl::Status TaskThread::FirstError() {
  absl::MutexLock lock(&mu_);
  return first_error_;
}

absl::Status TaskThread::Drain() {
  absl::MutexLock lock(&mu_);
  int64_t last = next_ticket_ - 1;
  auto finished = [this, last] { return completed_ >= last; };
  mu_.Await(absl::Condition(&finished));
  done_.clear();
  return first_error_;
}

}  // namespace zeroshard
