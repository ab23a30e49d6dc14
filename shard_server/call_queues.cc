#include "shard_server/call_queues.h"

#include <algorithm>
#include <cassert>

#include "grpcpp/alarm.h"

namespace zeroshard {

CallQueues::Call::Call(CallQueues* owner) : owner_(owner) { owner_->CallStarted(); }

void CallQueues::Call::End() {
  CallQueues* owner = owner_;
  delete this;
  owner->CallEnded();  // last: Stop() may destroy the queue once it sees 0
}

// One queue's lag probe: an alarm due every kEvery, timed when the queue's
// thread gets to it.
class CallQueues::LagProbe final : public CallQueues::Call {
 public:
  static constexpr absl::Duration kEvery = absl::Milliseconds(100);

  LagProbe(CallQueues* owner, grpc::ServerCompletionQueue* queue, ProbeTimes* times)
      : Call(owner), owner_(owner), queue_(queue), times_(times) {
    Arm(absl::Now());
  }

  void Proceed(int /*step*/, bool /*ok*/) override {
    const absl::Time now = absl::Now();
    const absl::Time due = absl::FromUnixMicros(times_->due_us.load(std::memory_order_relaxed));
    times_->lag_us.store(absl::ToInt64Microseconds(std::max(now - due, absl::ZeroDuration())),
                         std::memory_order_relaxed);
    if (owner_->stopping_.load()) return End();
    Arm(now + kEvery);
  }

 private:
  void Arm(absl::Time due) {
    times_->due_us.store(absl::ToUnixMicros(due), std::memory_order_relaxed);
    alarm_.Set(queue_, absl::ToChronoTime(due), &tag_);
  }

  CallQueues* const owner_;
  grpc::ServerCompletionQueue* const queue_;
  ProbeTimes* const times_;
  grpc::Alarm alarm_;
  Tag tag_{this, 0};
};

CallQueues::CallQueues(grpc::ServerBuilder* builder, int queues) {
  assert(queues >= 1);
  for (int i = 0; i < queues; ++i) queues_.push_back(builder->AddCompletionQueue());
}

CallQueues::~CallQueues() { Stop(); }

void CallQueues::Start(const std::vector<Acceptor>& acceptors) {
  assert(pollers_.empty());
  for (const std::unique_ptr<grpc::ServerCompletionQueue>& queue : queues_) {
    for (const Acceptor& accept : acceptors) accept(queue.get());
    probe_times_.push_back(std::make_unique<ProbeTimes>());
    new LagProbe(this, queue.get(), probe_times_.back().get());
    pollers_.emplace_back([this, q = queue.get()] { Poll(q); });
  }
}

absl::Duration CallQueues::Lag() const {
  const int64_t now_us = absl::ToUnixMicros(absl::Now());
  int64_t worst_us = 0;
  for (const std::unique_ptr<ProbeTimes>& times : probe_times_) {
    worst_us = std::max(worst_us, times->lag_us.load(std::memory_order_relaxed));
    // An alarm overdue and not yet run: its thread is at least that late.
    worst_us = std::max(worst_us, now_us - times->due_us.load(std::memory_order_relaxed));
  }
  return absl::Microseconds(worst_us);
}

void CallQueues::Poll(grpc::ServerCompletionQueue* queue) {
  void* tag = nullptr;
  bool ok = false;
  while (queue->Next(&tag, &ok)) {
    auto* event = static_cast<Call::Tag*>(tag);
    event->call->Proceed(event->step, ok);
  }
}

void CallQueues::CallStarted() {
  absl::MutexLock lock(&mu_);
  ++live_calls_;
}

void CallQueues::CallEnded() {
  absl::MutexLock lock(&mu_);
  --live_calls_;
}

void CallQueues::Stop() {
  {
    absl::MutexLock lock(&mu_);
    if (stopped_) return;
    stopped_ = true;
    stopping_ = true;  // each probe ends at its next alarm (within 100 ms)
    // The server's shutdown cancelled every call and accept: each call's
    // last event is on its way through the pollers.
    if (!pollers_.empty())
      mu_.Await(absl::Condition(
          +[](int* live) { return *live == 0; }, &live_calls_));
  }
  for (const std::unique_ptr<grpc::ServerCompletionQueue>& queue : queues_) queue->Shutdown();
  for (std::thread& poller : pollers_) poller.join();
  if (pollers_.empty()) {  // never started: drain here
    void* tag = nullptr;
    bool ok = false;
    for (const std::unique_ptr<grpc::ServerCompletionQueue>& queue : queues_) {
      while (queue->Next(&tag, &ok)) {
      }
    }
  }
}

}  // namespace zeroshard
