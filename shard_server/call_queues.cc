#include "shard_server/call_queues.h"

#include <cassert>

namespace zeroshard {

CallQueues::Call::Call(CallQueues* owner) : owner_(owner) { owner_->CallStarted(); }

void CallQueues::Call::End() {
  CallQueues* owner = owner_;
  delete this;
  owner->CallEnded();  // last: Stop() may destroy the queue once it sees 0
}

CallQueues::CallQueues(grpc::ServerBuilder* builder, int queues) {
  assert(queues >= 1);
  for (int i = 0; i < queues; ++i) queues_.push_back(builder->AddCompletionQueue());
}

CallQueues::~CallQueues() { Stop(); }

void CallQueues::Start(const std::vector<Acceptor>& acceptors) {
  assert(pollers_.empty());
  for (const std::unique_ptr<grpc::ServerCompletionQueue>& queue : queues_) {
    for (const Acceptor& accept : acceptors) accept(queue.get());
    pollers_.emplace_back([this, q = queue.get()] { Poll(q); });
  }
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
