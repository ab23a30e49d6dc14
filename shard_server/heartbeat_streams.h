// Coordinator.Heartbeat served with gRPC's async API over K completion queues,
// each polled by its own thread; every other method stays on the callback API
// (coordinator_service.h).
//
// Why not the callback API: Debian's libgrpc is built without NDEBUG, and in
// such a build every completion-queue event searches the queue's list of
// outstanding tags linearly (grpc completion_queue.cc, cq_check_tag). The
// callback API puts every stream's pending read into one process-wide queue,
// so a beat cost O(open streams): 31 us at 4,096 streams, 122 us at 32,768.
// Spread over K queues, a queue's list is W/K long (docs/scale.md).
//
// Semantics are the callback stream's: one beat read, answered, the next read;
// a stream that closes or breaks tells Membership at once
// (HeartbeatStreamClosed); the bearer token is checked when the stream opens,
// the job per beat.
#ifndef ZEROSHARD_SHARD_SERVER_HEARTBEAT_STREAMS_H_
#define ZEROSHARD_SHARD_SERVER_HEARTBEAT_STREAMS_H_

#include <memory>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "grpcpp/grpcpp.h"
#include "proto/zeroshard.grpc.pb.h"
#include "shard_server/job_credentials.h"
#include "shard_server/membership/membership.h"
#include "shard_server/observability/server_metrics.h"

namespace zeroshard {

// The Coordinator service type whose Heartbeat is async and every other
// method callback. The async marking must come first (innermost): gRPC 1.51
// drops the handler only when a sync method turns async, so
// WithAsyncMethod_Heartbeat<CallbackService> would keep the callback handler
// and never serve the async requests.
namespace heartbeat_internal {
using C = v1::Coordinator;
using Service = C::WithCallbackMethod_Join<C::WithCallbackMethod_Leave<
    C::WithCallbackMethod_StoreSet<C::WithCallbackMethod_StoreGet<C::WithCallbackMethod_StoreAdd<
        C::WithCallbackMethod_StoreWait<C::WithCallbackMethod_StoreCompareSet<
            C::WithCallbackMethod_StoreDelete<C::WithCallbackMethod_StoreCheck<
                C::WithCallbackMethod_StoreNumKeys<C::WithCallbackMethod_GetStatus<
                    C::WithCallbackMethod_PlanShards<C::WithCallbackMethod_CommitShard<
                        C::WithCallbackMethod_UploadShard<C::WithCallbackMethod_ListCheckpoints<
                            C::WithCallbackMethod_Consolidate<C::WithCallbackMethod_GetHistory<
                                C::WithAsyncMethod_Heartbeat<C::Service>>>>>>>>>>>>>>>>>>;
}  // namespace heartbeat_internal
using HeartbeatAsyncService = heartbeat_internal::Service;

class HeartbeatStreams {
 public:
  // Adds `queues` (>= 1) completion queues to `builder`; construct before
  // builder.BuildAndStart(). Pointers are not owned and outlive this object;
  // `metrics` may be null (beats not counted).
  HeartbeatStreams(HeartbeatAsyncService* service, Membership* membership, ServerMetrics* metrics,
                   JobCredentials* credentials, grpc::ServerBuilder* builder, int queues);
  ~HeartbeatStreams();  // Stop()

  // Accepts streams on every queue and starts its polling thread. Call once,
  // after the server started.
  void Start();
  // Call after grpc::Server::Shutdown (which cancels every stream): waits
  // until every stream is finished, then shuts the queues down, drains them
  // and joins the threads. Idempotent.
  void Stop();

  // One stream's state machine; public only for the .cc's use.
  class Call;

 private:
  friend class Call;
  void Poll(grpc::ServerCompletionQueue* queue);
  void CallStarted();
  void CallEnded();

  HeartbeatAsyncService* const service_;
  Membership* const membership_;
  ServerMetrics* const metrics_;  // may be null
  JobCredentials* const credentials_;
  std::vector<std::unique_ptr<grpc::ServerCompletionQueue>> queues_;
  std::vector<std::thread> pollers_;  // one per queue, from Start() to Stop()
  absl::Mutex mu_;
  // Calls alive (accepting or streaming): a queue is shut down only at 0,
  // since an operation started on a shut-down queue aborts the process.
  int live_calls_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace zeroshard

#endif  // ZEROSHARD_SHARD_SERVER_HEARTBEAT_STREAMS_H_
