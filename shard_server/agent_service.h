// The zeroshard.v1.HostAgent gRPC service: one heartbeat stream per host,
// opened by the host's node agent (agent/shard_agent.cc), and the host's joins
// in one call. Each rank is judged as on its own Heartbeat stream: the beats go
// to Membership::Heartbeat and the closes to Membership::HeartbeatStreamClosed,
// each rank under a stream id of its own, so fencing, the failure detector's
// rules and auth are the same code as for direct streams. What is new is only
// the mapping:
//
//   agent reports rank stream L closed   -> HeartbeatStreamClosed(rank, id(L))
//   the agent's own stream closes        -> HeartbeatStreamClosed for every
//                                           rank that beat through it
//   the agent goes silent (host cut)     -> its ranks go silent: the timeout
//
// so a lost host is its ranks lost, as when their own streams broke.
#ifndef ZEROSHARD_SHARD_SERVER_AGENT_SERVICE_H_
#define ZEROSHARD_SHARD_SERVER_AGENT_SERVICE_H_

#include "proto/zeroshard.grpc.pb.h"
#include "shard_server/clock.h"
#include "shard_server/job_credentials.h"
#include "shard_server/membership/membership.h"
#include "shard_server/observability/event_log.h"
#include "shard_server/observability/server_metrics.h"
#include "shard_server/worker_id_binding.h"

namespace zeroshard {

class HostAgentService final : public v1::HostAgent::CallbackService {
 public:
  // Pointers are not owned; `metrics` and `log` may be null.
  HostAgentService(Clock* clock, Membership* membership, JobCredentials* credentials,
                   ServerMetrics* metrics, EventLog* log);

  grpc::ServerBidiReactor<v1::HostHeartbeatRequest, v1::HostHeartbeatResponse>* HostHeartbeat(
      grpc::CallbackServerContext* context) override;
  // With mutual TLS: the worker ids each client certificate may join as
  // (null: any). Not owned; call before serving.
  void SetWorkerIdBinding(const WorkerIdBinding* binding) { worker_ids_ = binding; }

  grpc::ServerWriteReactor<v1::HostJoinResponse>* HostJoin(
      grpc::CallbackServerContext* context, const v1::HostJoinRequest* request) override;

 private:
  Clock* const clock_;
  Membership* const membership_;
  JobCredentials* const credentials_;
  ServerMetrics* const metrics_;  // may be null
  EventLog* const log_;           // may be null
  const WorkerIdBinding* worker_ids_ = nullptr;
};

}  // namespace zeroshard

#endif  // ZEROSHARD_SHARD_SERVER_AGENT_SERVICE_H_
