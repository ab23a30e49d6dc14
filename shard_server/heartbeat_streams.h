// Coordinator.Heartbeat served with gRPC's async API on the server's call
// queues (call_queues.h: why not the callback API); every other Coordinator
// method stays on the callback API (coordinator_service.h).
//
// Semantics are the callback stream's: one beat read, answered, the next read;
// a stream that closes or breaks tells Membership at once
// (HeartbeatStreamClosed); the bearer token is checked when the stream opens,
// the job per beat.
#ifndef ZEROSHARD_SHARD_SERVER_HEARTBEAT_STREAMS_H_
#define ZEROSHARD_SHARD_SERVER_HEARTBEAT_STREAMS_H_

#include "grpcpp/grpcpp.h"
#include "proto/zeroshard.grpc.pb.h"
#include "shard_server/call_queues.h"
#include "shard_server/auth/job_credentials.h"
#include "shard_server/membership/membership.h"
#include "shard_server/observability/server_metrics.h"

namespace zeroshard {

// The Coordinator service type whose Heartbeat is async and every other
// method callback; StoreSet, StoreWait, StoreCheck and StoreCompareSet,
// whose requests may be megabytes, take their requests as bytes, counted
// before they are parsed (common/request_budget.h). The async marking must come first (innermost): gRPC 1.51
// drops the handler only when a sync method turns async, so
// WithAsyncMethod_Heartbeat<CallbackService> would keep the callback handler
// and never serve the async requests.
namespace heartbeat_internal {
using C = v1::Coordinator;
using Service = C::WithCallbackMethod_EvictHost<C::WithCallbackMethod_UnfenceHost<
    C::WithCallbackMethod_Join<C::WithCallbackMethod_Leave<
    C::WithRawCallbackMethod_StoreSet<C::WithCallbackMethod_StoreGet<C::WithCallbackMethod_StoreAdd<
        C::WithRawCallbackMethod_StoreWait<C::WithRawCallbackMethod_StoreCompareSet<
            C::WithCallbackMethod_StoreDelete<C::WithRawCallbackMethod_StoreCheck<
                C::WithCallbackMethod_StoreNumKeys<C::WithCallbackMethod_GetStatus<
                    C::WithCallbackMethod_PlanShards<C::WithCallbackMethod_CommitShard<
                        C::WithCallbackMethod_UploadShard<C::WithCallbackMethod_ListCheckpoints<
                            C::WithCallbackMethod_Consolidate<C::WithCallbackMethod_GetHistory<
                                C::WithAsyncMethod_Heartbeat<C::Service>>>>>>>>>>>>>>>>>>>>;
}  // namespace heartbeat_internal
using HeartbeatAsyncService = heartbeat_internal::Service;

// What the heartbeat streams use. Pointers are not owned and outlive every
// call; `metrics` may be null (beats not counted).
struct HeartbeatStreamServices {
  HeartbeatAsyncService* service = nullptr;
  Membership* membership = nullptr;
  ServerMetrics* metrics = nullptr;
  JobCredentials* credentials = nullptr;
};

// The acceptor of Heartbeat streams for CallQueues::Start: each queue it is
// run on serves streams from then on.
CallQueues::Acceptor AcceptHeartbeatStreams(CallQueues* queues, HeartbeatStreamServices services);

}  // namespace zeroshard

#endif  // ZEROSHARD_SHARD_SERVER_HEARTBEAT_STREAMS_H_
