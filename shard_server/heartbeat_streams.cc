#include "shard_server/heartbeat_streams.h"

#include <atomic>
#include <utility>

#include "shard_server/grpc_status.h"

namespace zeroshard {
namespace {

// One heartbeat stream, from the request that accepts it to its finish. Every
// step runs on its queue's thread, one at a time: no lock is needed.
class HeartbeatCall final : public CallQueues::Call {
 public:
  enum Step { kAccepted, kRead, kWritten, kFinished };

  // Asks for the next stream to arrive on `queue`.
  HeartbeatCall(CallQueues* queues, HeartbeatStreamServices services,
                grpc::ServerCompletionQueue* queue)
      : Call(queues), queues_(queues), services_(services), queue_(queue), stream_(&context_) {
    services_.service->RequestHeartbeat(&context_, &stream_, queue_, queue_, &accepted_);
  }

  void Proceed(int step, bool ok) override {
    switch (step) {
      case kAccepted:
        return Accepted(ok);
      case kRead:
        return BeatRead(ok);
      case kWritten:
        return ReplyWritten(ok);
      default:
        return End();
    }
  }

 private:
  void Accepted(bool ok) {
    if (!ok) return End();  // the server is shutting down: no stream came
    new HeartbeatCall(queues_, services_, queue_);  // the next stream on this queue
    absl::StatusOr<Caller> caller = services_.credentials->Identify(context_.client_metadata());
    if (!caller.ok()) return Finish(ToGrpcStatus(caller.status()));
    caller_ = *std::move(caller);
    stream_.Read(&request_, &read_);
  }

  void BeatRead(bool ok) {
    if (!ok) {  // the member closed its side, or its process is gone
      if (request_.has_member()) services_.membership->HeartbeatStreamClosed(request_.member(), id_);
      return Finish(grpc::Status::OK);
    }
    if (grpc::Status allowed = caller_.MayActOn(request_.member().job_id()); !allowed.ok()) {
      return Finish(allowed);  // before anything of the member is touched
    }
    if (services_.metrics != nullptr) services_.metrics->AddHeartbeat();
    absl::StatusOr<v1::HeartbeatResponse> response =
        services_.membership->Heartbeat(request_, id_);
    if (!response.ok()) return Finish(ToGrpcStatus(response.status()));
    response_ = *std::move(response);
    stream_.Write(response_, &written_);
  }

  void ReplyWritten(bool ok) {
    if (!ok) {
      if (request_.has_member()) services_.membership->HeartbeatStreamClosed(request_.member(), id_);
      return Finish(grpc::Status(grpc::StatusCode::CANCELLED, "heartbeat stream broken"));
    }
    stream_.Read(&request_, &read_);
  }

  void Finish(const grpc::Status& status) { stream_.Finish(status, &finished_); }

  // Tells this stream from the member's earlier and later ones (never 0).
  static inline std::atomic<uint64_t> next_id_{1};
  const uint64_t id_ = next_id_.fetch_add(1, std::memory_order_relaxed);
  CallQueues* const queues_;
  const HeartbeatStreamServices services_;
  grpc::ServerCompletionQueue* const queue_;
  grpc::ServerContext context_;
  grpc::ServerAsyncReaderWriter<v1::HeartbeatResponse, v1::HeartbeatRequest> stream_;
  Caller caller_;
  v1::HeartbeatRequest request_;
  v1::HeartbeatResponse response_;
  Tag accepted_{this, kAccepted};
  Tag read_{this, kRead};
  Tag written_{this, kWritten};
  Tag finished_{this, kFinished};
};

}  // namespace

CallQueues::Acceptor AcceptHeartbeatStreams(CallQueues* queues, HeartbeatStreamServices services) {
  return [queues, services](grpc::ServerCompletionQueue* queue) {
    new HeartbeatCall(queues, services, queue);
  };
}

}  // namespace zeroshard
