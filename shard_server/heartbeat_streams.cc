#include "shard_server/heartbeat_streams.h"

#include <atomic>
#include <cassert>
#include <utility>

#include "absl/time/clock.h"
#include "shard_server/grpc_status.h"

namespace zeroshard {

// One heartbeat stream, from the request that accepts it to its finish. Every
// step runs on its queue's thread, one at a time: no lock is needed.
class HeartbeatStreams::Call {
 public:
  enum class Step { kAccepted, kRead, kWritten, kFinished };
  // What a queue event names: the call and which of its operations completed.
  struct Tag {
    Call* call;
    Step step;
  };

  // Asks for the next stream to arrive on `queue`.
  Call(HeartbeatStreams* owner, grpc::ServerCompletionQueue* queue)
      : owner_(owner), queue_(queue), stream_(&context_) {
    owner_->CallStarted();
    owner_->service_->RequestHeartbeat(&context_, &stream_, queue_, queue_, &accepted_);
  }

  // `ok`: the operation succeeded. May delete this.
  void Proceed(Step step, bool ok) {
    switch (step) {
      case Step::kAccepted:
        return Accepted(ok);
      case Step::kRead:
        return BeatRead(ok);
      case Step::kWritten:
        return ReplyWritten(ok);
      case Step::kFinished:
        return End();
    }
  }

 private:
  void Accepted(bool ok) {
    if (!ok) return End();     // the server is shutting down: no stream came
    new Call(owner_, queue_);  // the next stream on this queue
    absl::StatusOr<Caller> caller = owner_->credentials_->Identify(context_.client_metadata());
    if (!caller.ok()) return Finish(ToGrpcStatus(caller.status()));
    caller_ = *std::move(caller);
    stream_.Read(&request_, &read_);
  }

  void BeatRead(bool ok) {
    if (!ok) {  // the member closed its side, or its process is gone
      if (request_.has_member()) owner_->membership_->HeartbeatStreamClosed(request_.member(), id_);
      return Finish(grpc::Status::OK);
    }
    if (grpc::Status allowed = caller_.MayActOn(request_.member().job_id()); !allowed.ok()) {
      return Finish(allowed);  // before anything of the member is touched
    }
    const absl::Time read = absl::Now();
    absl::StatusOr<v1::HeartbeatResponse> response = owner_->membership_->Heartbeat(request_, id_);
    if (owner_->metrics_ != nullptr) {
      owner_->metrics_->AddHeartbeat();
      owner_->metrics_->AddHeartbeatHandling(absl::Now() - read);
    }
    if (!response.ok()) return Finish(ToGrpcStatus(response.status()));
    response_ = *std::move(response);
    stream_.Write(response_, &written_);
  }

  void ReplyWritten(bool ok) {
    if (!ok) {
      if (request_.has_member()) owner_->membership_->HeartbeatStreamClosed(request_.member(), id_);
      return Finish(grpc::Status(grpc::StatusCode::CANCELLED, "heartbeat stream broken"));
    }
    stream_.Read(&request_, &read_);
  }

  void Finish(const grpc::Status& status) { stream_.Finish(status, &finished_); }

  void End() {
    HeartbeatStreams* owner = owner_;
    delete this;
    owner->CallEnded();  // last: Stop() may destroy the queue once it sees 0
  }

  // Tells this stream from the member's earlier and later ones (never 0).
  static inline std::atomic<uint64_t> next_id_{1};
  const uint64_t id_ = next_id_.fetch_add(1, std::memory_order_relaxed);
  HeartbeatStreams* const owner_;
  grpc::ServerCompletionQueue* const queue_;
  grpc::ServerContext context_;
  grpc::ServerAsyncReaderWriter<v1::HeartbeatResponse, v1::HeartbeatRequest> stream_;
  Caller caller_;
  v1::HeartbeatRequest request_;
  v1::HeartbeatResponse response_;
  Tag accepted_{this, Step::kAccepted};
  Tag read_{this, Step::kRead};
  Tag written_{this, Step::kWritten};
  Tag finished_{this, Step::kFinished};
};

HeartbeatStreams::HeartbeatStreams(HeartbeatAsyncService* service, Membership* membership,
                                   ServerMetrics* metrics, JobCredentials* credentials,
                                   grpc::ServerBuilder* builder, int queues)
    : service_(service), membership_(membership), metrics_(metrics), credentials_(credentials) {
  assert(queues >= 1);
  for (int i = 0; i < queues; ++i) queues_.push_back(builder->AddCompletionQueue());
}

HeartbeatStreams::~HeartbeatStreams() { Stop(); }

void HeartbeatStreams::Start() {
  assert(pollers_.empty());
  for (const std::unique_ptr<grpc::ServerCompletionQueue>& queue : queues_) {
    new Call(this, queue.get());
    pollers_.emplace_back([this, q = queue.get()] { Poll(q); });
  }
}

void HeartbeatStreams::Poll(grpc::ServerCompletionQueue* queue) {
  void* tag = nullptr;
  bool ok = false;
  while (queue->Next(&tag, &ok)) {
    auto* event = static_cast<Call::Tag*>(tag);
    event->call->Proceed(event->step, ok);
  }
}

void HeartbeatStreams::CallStarted() {
  absl::MutexLock lock(&mu_);
  ++live_calls_;
}

void HeartbeatStreams::CallEnded() {
  absl::MutexLock lock(&mu_);
  --live_calls_;
}

void HeartbeatStreams::Stop() {
  {
    absl::MutexLock lock(&mu_);
    if (stopped_) return;
    stopped_ = true;
    // The server's shutdown cancelled every stream and accept: each call's
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
