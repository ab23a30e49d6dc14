// The node agent (shard_agent): one per host, between the host's ranks and the
// shard server. The ranks speak today's Coordinator.Heartbeat and Join to it
// (shard_worker --agent); it speaks HostAgent to the server (proto: one
// HostHeartbeat stream per host, joins in batches), so the server holds one
// stream per host instead of one per rank (docs/scale.md).
//
// It also serves the ranks' StoreWaits: those of a host's ranks for the same
// keys share one call to the server (store_wait_fan_out.h).
//
// What it adds is only transport: every beat and join is the rank's own
// (credentials, incarnation, telemetry), each answer goes back to the rank it
// belongs to, and a rank's stream closing is reported to the server at once,
// where it counts as that rank's own stream closing. It holds no token of its
// own: it forwards the bearer token its ranks present, one upstream stream
// per token, kept while some rank's call presents it (at most 256 tokens at
// once). It checks no token either, so it shares nothing the server has not
// accepted (#44): join batches are per job, shared StoreWaits only among
// credentials the server issued or accepted through it
// (verified_credentials.h), and a token the server refuses for the whole
// stream is answered so at once to every rank that presented it.
//
// Every request it holds is counted (a beat or join over 16 KiB, which the
// server would refuse, is refused here INVALID_ARGUMENT): docs/design.md's
// ledger.
//
// Thread-safe. Threads: gRPC's for the local service; one per upstream stream
// (its writer) and one reading it; one per join batch in flight; one that
// stops and frees the upstreams and fan-outs no rank uses any more.
#ifndef ZEROSHARD_AGENT_HOST_AGENT_H_
#define ZEROSHARD_AGENT_HOST_AGENT_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/client.h"
#include "grpcpp/grpcpp.h"

namespace zeroshard {

struct HostAgentOptions {
  ClientOptions server;  // how to reach the server (address, TLS; the token is unused)
  // Set: the agent reaches the server on this channel instead of
  // connecting to `server` (fuzzers and tests: a server in the process).
  std::shared_ptr<grpc::Channel> server_channel;
  // Where the ranks reach the agent: "unix:PATH" or "127.0.0.1:PORT"
  // (port 0 picks one).
  std::string listen;
  // "<hostname> <boot id>" (common/local_address.h HostIdentity); sent to
  // the server with every request, for its log.
  std::string node;
  // Beats that arrive within this of the first queued one go in one request
  // (a rank's failed-collective beat and stream closes go at once).
  absl::Duration batch_window = absl::Milliseconds(20);
  // Joins likewise: the ranks of a host join within a few milliseconds of
  // each other at start and after a failure.
  absl::Duration join_window = absl::Milliseconds(50);
  // What the ranks' calls may make the agent hold (#44's ledger): their
  // requests as parsed and as forwarded (beats queued or in flight, joins
  // in batches, waits held) and 32 KiB of gRPC state per unary call, at once;
  // beyond, a call or beat is refused RESOURCE_EXHAUSTED
  // (--max_request_bytes_in_flight).
  size_t max_request_bytes_in_flight = size_t{256} << 20;
  // Rank heartbeat streams open at once (--max_rank_streams); beyond,
  // refused RESOURCE_EXHAUSTED. A host has a few ranks a job.
  int max_rank_streams = 4096;
};

class HostAgent {
 public:
  // Listens on options.listen and connects to the server lazily (the first
  // rank's beat or join).
  static absl::StatusOr<std::unique_ptr<HostAgent>> Start(HostAgentOptions options);
  // Ends every rank's stream and call (UNAVAILABLE), then the upstream ones.
  ~HostAgent();
  HostAgent(const HostAgent&) = delete;
  HostAgent& operator=(const HostAgent&) = delete;

  // The address ranks reach it at (the bound port for "HOST:0").
  const std::string& address() const;

  // The bootstrap fan-out (agent/store_wait_fan_out.h), for tests: the
  // ranks' StoreWaits held now, and the StoreWaits sent to the server.
  struct StoreWaitCounts {
    int held = 0;
    int64_t server_calls = 0;
  };
  StoreWaitCounts StoreWaits();

  class Impl;

 private:
  explicit HostAgent(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace zeroshard

#endif  // ZEROSHARD_AGENT_HOST_AGENT_H_
