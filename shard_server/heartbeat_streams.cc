#include "shard_server/heartbeat_streams.h"

#include <atomic>
#include <utility>

#include "absl/time/clock.h"
#include "shard_server/base/grpc_status.h"

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
    identified_ = absl::Now();
    stream_.Read(&request_, &read_);
  }

  void BeatRead(bool ok) {
    if (!ok) {  // the member closed its side, or its process is gone
      if (request_.has_member()) services_.membership->HeartbeatStreamClosed(request_.member(), id_);
      return Finish(grpc::Status::OK);
    }
    if (grpc::Status token = StillIdentified(); !token.ok()) return Finish(token);
    if (grpc::Status allowed = caller_.MayActOn(request_.member().job_id()); !allowed.ok()) {
      return Finish(allowed);  // before anything of the member is touched
    }
    const absl::Time read = absl::Now();
    absl::StatusOr<v1::HeartbeatResponse> response =
        services_.membership->Heartbeat(request_, id_);
    if (services_.metrics != nullptr) {
      services_.metrics->AddHeartbeat();
      services_.metrics->AddHeartbeatHandling(absl::Now() - read);
    }
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

  // A job token is checked again at most once a second: a revoked one (its
  // file removed) ends the stream (#44 finding 10). The admin token cannot
  // be revoked while the server runs.
  grpc::Status StillIdentified() {
    if (caller_.admin) return grpc::Status::OK;
    const absl::Time now = absl::Now();
    if (now - identified_ < absl::Seconds(1)) return grpc::Status::OK;
    identified_ = now;
    absl::StatusOr<Caller> caller = services_.credentials->Identify(context_.client_metadata());
    if (!caller.ok()) return ToGrpcStatus(caller.status());
    caller_ = *std::move(caller);
    return grpc::Status::OK;
  }

  // Tells this stream from the member's earlier and later ones (never 0).
  static inline std::atomic<uint64_t> next_id_{1};
  const uint64_t id_ = next_id_.fetch_add(1, std::memory_order_relaxed);
  CallQueues* const queues_;
  const HeartbeatStreamServices services_;
  grpc::ServerCompletionQueue* const queue_;
  grpc::ServerContext context_;
  grpc::ServerAsyncReaderWriter<v1::HeartbeatResponse, v1::HeartbeatRequest> stream_;
  Caller caller_;
  absl::Time identified_;  // when caller_ was last checked
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
