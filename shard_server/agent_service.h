// The zeroshard.v1.HostAgent gRPC service: one heartbeat stream per host,
// opened by the host's node agent (agent/shard_agent.cc), and the host's joins
// in one call, both served with gRPC's async API on the server's call queues
// (call_queues.h: a job of 100,000 ranks holds 12,500 of each). Each rank is
// judged as on its own Heartbeat stream: the beats go to Membership::Heartbeat
// and the closes to Membership::HeartbeatStreamClosed, each rank under a stream id of its own, so fencing, the failure detector's
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
#include "shard_server/call_queues.h"
#include "shard_server/base/clock.h"
#include "shard_server/auth/job_credentials.h"
#include "shard_server/membership/membership.h"
#include "shard_server/base/event_log.h"
#include "shard_server/observability/server_metrics.h"
#include "shard_server/auth/worker_id_binding.h"

namespace zeroshard {

// What the agents' calls use. Pointers are not owned and outlive every call;
// `metrics` and `log` may be null.
struct HostAgentServices {
  v1::HostAgent::AsyncService* service = nullptr;
  Clock* clock = nullptr;
  Membership* membership = nullptr;
  JobCredentials* credentials = nullptr;
  ServerMetrics* metrics = nullptr;
  EventLog* log = nullptr;
  // With mutual TLS: the worker ids each client certificate may join as
  // (null: any).
  const WorkerIdBinding* worker_ids = nullptr;
};

// The acceptors of HostHeartbeat streams and HostJoin calls for
// CallQueues::Start: each queue they are run on serves both from then on.
CallQueues::Acceptor AcceptHostHeartbeats(CallQueues* queues, HostAgentServices services);
CallQueues::Acceptor AcceptHostJoins(CallQueues* queues, HostAgentServices services);

}  // namespace zeroshard

#endif  // ZEROSHARD_SHARD_SERVER_AGENT_SERVICE_H_
