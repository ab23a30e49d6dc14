// shard_agent: the node agent, one per host (docs/scale.md). The host's ranks
// reach it with shard_worker --agent=ADDRESS; it holds the host's one
// heartbeat stream to the server.
//
//   shard_agent --server=HOST:PORT --listen=unix:/run/zeroshard/agent.sock
//
// A separate process, not a mode of a worker: it must outlive any one rank to
// report that rank's death (a killed rank's stream to it closes, and the
// server hears of it at once), and a host's ranks start, die and restart
// independently of each other.
#include <csignal>
#include <cstdio>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "agent/host_agent.h"
#include "client/connection_flags.h"
#include "common/local_address.h"

ABSL_FLAG(std::string, listen, "unix:/run/zeroshard/agent.sock",
          "Where the host's ranks reach the agent: unix:PATH (its directory made if missing), "
          "or 127.0.0.1:PORT (port 0: any); give the workers the same with --agent");
ABSL_FLAG(int, batch_window_ms, 20,
          "Beats of the host's ranks that arrive within this many ms go to the server in one "
          "message (a failed collective's beat and a rank's death go at once)");

ABSL_FLAG(int64_t, max_request_bytes_in_flight, int64_t{256} << 20,
          "Bytes the ranks' requests may make the agent hold at once (beats in flight, joins in "
          "batches, waits held, as parsed and as forwarded); beyond, refused RESOURCE_EXHAUSTED");
ABSL_FLAG(int, max_rank_streams, 4096,
          "Rank heartbeat streams open at once; beyond, refused RESOURCE_EXHAUSTED");

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "The node agent: one per host, between the host's ranks (shard_worker --agent) and the "
      "shard server, so the server holds one heartbeat stream per host.\n"
      "  shard_agent --server=HOST:PORT --listen=unix:/run/zeroshard/agent.sock");
  absl::ParseCommandLine(argc, argv);
  // Signals are taken by this thread alone (sigwait below).
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  absl::StatusOr<zeroshard::ClientOptions> server = zeroshard::ClientOptionsFromFlags();
  if (!server.ok()) {
    std::fprintf(stderr, "shard_agent: %s\n", server.status().ToString().c_str());
    return 2;
  }
  if (server->server.empty()) {
    std::fprintf(stderr, "shard_agent: --server is required (HOST:PORT of the shard server)\n");
    return 2;
  }
  zeroshard::HostAgentOptions options;
  options.server = *std::move(server);
  options.listen = absl::GetFlag(FLAGS_listen);
  if (absl::Status s = zeroshard::CheckListenAddress("listen", options.listen, true); !s.ok()) {
    std::fprintf(stderr, "shard_agent: %s\n", std::string(s.message()).c_str());
    return 2;
  }
  options.node = zeroshard::HostIdentity();
  options.batch_window = absl::Milliseconds(absl::GetFlag(FLAGS_batch_window_ms));
  if (absl::GetFlag(FLAGS_batch_window_ms) < 0) {
    std::fprintf(stderr, "shard_agent: --batch_window_ms=%d: expected 0 or more milliseconds\n",
                 absl::GetFlag(FLAGS_batch_window_ms));
    return 2;
  }
  if (absl::GetFlag(FLAGS_max_request_bytes_in_flight) < 1) {
    std::fprintf(stderr, "shard_agent: --max_request_bytes_in_flight=%lld: expected 1 or more\n",
                 static_cast<long long>(absl::GetFlag(FLAGS_max_request_bytes_in_flight)));
    return 2;
  }
  if (absl::GetFlag(FLAGS_max_rank_streams) < 1) {
    std::fprintf(stderr, "shard_agent: --max_rank_streams=%d: expected 1 or more\n",
                 absl::GetFlag(FLAGS_max_rank_streams));
    return 2;
  }
  options.max_request_bytes_in_flight =
      static_cast<size_t>(absl::GetFlag(FLAGS_max_request_bytes_in_flight));
  options.max_rank_streams = absl::GetFlag(FLAGS_max_rank_streams);
  absl::StatusOr<std::unique_ptr<zeroshard::HostAgent>> agent =
      zeroshard::HostAgent::Start(options);
  if (!agent.ok()) {
    std::fprintf(stderr, "shard_agent: %s\n", agent.status().ToString().c_str());
    return 1;
  }
  std::fprintf(stderr, "shard_agent: listening on %s for the ranks of %s, server %s\n",
               (*agent)->address().c_str(), options.node.c_str(), options.server.server.c_str());
  int sig = 0;
  sigwait(&signals, &sig);
  std::fprintf(stderr, "shard_agent: signal %d, shutting down\n", sig);
  agent->reset();
  return 0;
}
